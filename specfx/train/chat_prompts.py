"""Training prompts for a chat model's heads, of the eight kinds the chat suite measures
(``specfx bench suite``), built without any outside dataset:

* code writing / code editing: functions of the Python standard library on this machine (PSF
  licence), by name, signature and first docstring sentence, or by source with an edit request;
* math: word problems from templates with random numbers;
* passages: the target itself writes short reports and explanations on listed topics (stage 1);
  its passages then become the material of summaries, passage questions, retrieval questions
  over three documents and translations (stage 2);
* multi-turn: the target's own first answer, then a follow-up request (stage 2).

Stage 1 is :func:`stage_one`; :func:`stage_two` takes the stage-1 answers
(:mod:`specfx.train.respond`'s output). Everything is a pure function of ``seed``. No prompt
equals one of the suite's (its prompts are the held-out evaluation): :func:`check_disjoint`.

``python -m specfx.train.chat_prompts stage1 OUT.jsonl`` /
``python -m specfx.train.chat_prompts stage2 ANSWERS1.jsonl OUT.jsonl``.
"""

from __future__ import annotations

import ast
import json
import random
import sys
import sysconfig
from pathlib import Path

from specfx.bench.stdlib_code import parsed_files, source_of

__all__ = ["stage_one", "stage_two", "check_disjoint", "SUITE_PROMPTS"]

SUITE_PROMPTS = Path(__file__).resolve().parent.parent / "bench" / "prompts" / "suite.jsonl"

# fmt: off
SUBJECTS = [
    "a town council", "a primary school", "a small bakery", "a local museum", "a football club", "a hospital",
    "a public library", "a railway company", "a river clean-up group", "a farmers' market", "a university lab",
    "a software start-up", "a theatre company", "a city zoo", "a fishing village", "a mountain rescue team",
    "a recycling plant", "a bicycle shop", "a community garden", "a chess club", "a weather service",
    "an orchestra", "an airport", "a ferry service", "a bookshop", "a youth hostel", "a solar farm",
    "a coffee roastery", "a dance school", "a volunteer fire brigade",
]
EVENTS = [
    "opened a new building", "changed its opening hours", "won a regional award", "started a recycling scheme",
    "hired twenty new staff", "cut its prices", "raised money for a charity", "closed for repairs",
    "launched a mobile app", "celebrated its hundredth anniversary", "was hit by a storm", "reduced its energy use",
    "ran a free weekend event", "planted a thousand trees", "announced a new director",
]
TOPICS = [
    "how vaccines train the immune system", "why the sky is blue", "how a bicycle gear works", "what compound interest is",
    "how bees make honey", "why leaves change colour in autumn", "how a refrigerator keeps food cold",
    "what a binary search does", "how tides are caused by the moon", "how a bill becomes a law",
    "what photosynthesis is", "how noise-cancelling headphones work", "why bread rises", "what inflation means",
    "how a compiler turns code into a program", "how earthquakes are measured", "what a hash table is",
    "how solar panels make electricity", "why we have leap years", "how the heart pumps blood",
    "what recursion is in programming", "how glaciers shape valleys", "how a credit score works",
    "what a neural network is", "how rainbows form", "why exercise improves mood", "how a lock and key work",
    "how satellites stay in orbit", "what version control is", "how coffee is decaffeinated",
]
ADVICE = [
    "learn to play the guitar as an adult", "start running three times a week", "keep houseplants alive in a dark flat",
    "prepare for a job interview", "save money on groceries", "learn a new language in a year",
    "organise a small wedding", "travel with a dog", "write a first novel", "get better sleep",
    "start a vegetable patch on a windowsill", "teach a child to ride a bike", "move to a new city alone",
    "host a dinner for ten people", "learn Python from scratch", "reduce screen time", "train for a 10 km race",
    "decorate a small bedroom", "keep a journal every day", "study for an exam in two weeks",
    "start a podcast", "buy a used car", "make friends after moving", "learn to cook healthy meals",
    "plan a camping trip", "pick a first programming project", "speak confidently in meetings",
    "care for an older cat", "choose a laptop for university", "volunteer in my community",
]
FOLLOW_UPS = [
    "Can you make that shorter, as a bullet list?", "Which of those should I do first, and why?",
    "Can you give me a concrete example?", "What are the most common mistakes people make?",
    "How long will it take before I see results?", "Explain it again as if I were twelve.",
    "What would it cost, roughly?", "Can you turn that into a one-week plan?",
]
CODE_EDITS = [
    "Add type hints to this function. Keep the behaviour unchanged.",
    "Write a docstring for this function and return the whole function.",
    "Explain what this function does, step by step.",
    "Rename the variables in this function to more descriptive names.",
    "Write two unit tests for this function with pytest.",
    "Find a possible bug or edge case in this function and explain how to fix it.",
    "Rewrite this function to be shorter and more readable.",
    "Add comments to this function explaining each part.",
]
# fmt: on
LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese", "Dutch"]
NAMES = ["Ana", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jamal", "Kira", "Liam"]
ITEMS = [("apples", 3), ("notebooks", 4), ("tickets", 12), ("pencils", 1), ("cakes", 6), ("books", 9), ("plants", 7)]


def _std_functions(seed: int, lo: int = 4, hi: int = 22) -> list[tuple[str, str, str, str, str]]:
    """(module, name, signature line, first docstring sentence, source) of stdlib functions of
    ``lo..hi`` lines with a docstring, shuffled by ``seed``."""
    found = []
    for path, tree, lines in parsed_files(sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))):
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or node.decorator_list:
                continue
            doc = ast.get_docstring(node)
            size = node.end_lineno - node.lineno + 1
            src = source_of(node, lines) if doc and lo <= size <= hi else None
            if src is None:
                continue
            first = doc.strip().split("\n\n")[0].replace("\n", " ").split(". ")[0].rstrip(".")
            found.append((path.stem, node.name, src.splitlines()[0].rstrip(":"), first, src))
    random.Random(seed).shuffle(found)
    return found


def _user(pid: str, category: str, text: str) -> dict:
    return {"id": pid, "category": category, "messages": [{"role": "user", "content": text}]}


def _math(rng: random.Random, i: int) -> str:
    a, b = rng.sample(NAMES, 2)
    item, price = rng.choice(ITEMS)
    n, m, k = rng.randint(3, 40), rng.randint(2, 9), rng.randint(2, 5)
    forms = [
        f"{a} buys {n} {item} at {price} dollars each and pays with a {price * n + rng.choice([5, 10, 20])}-dollar note. How much change does {a} get?",
        f"{a} has {n} {item}. {b} has {k} times as many. They give away {m} each. How many {item} do they have left together?",
        f"A train travels {n * 10} km in {k} hours. At the same speed, how far does it go in {k + m} hours?",
        f"A class of {n + 10} pupils is split into groups of {k}. How many full groups are there, and how many pupils are left over?",
        f"{a} saves {m} dollars a week. How many weeks until {a} can buy a bike that costs {m * n + k} dollars?",
        f"A rectangle is {n} cm long and {m} cm wide. What are its area and its perimeter?",
        f"{a} reads {m * 5} pages a day. The book has {n * 12} pages. On which day does {a} finish it?",
        f"A shop gives {k * 5}% off a coat that costs {n * 5} dollars. What is the new price?",
    ]
    tail = rng.choice(["Solve it step by step.", "Show your working.", "Explain your reasoning, then give the answer."])
    return f"{forms[i % len(forms)]} {tail}"


def stage_one(seed: int = 0, per_kind: int = 150) -> list[dict]:
    """Prompts that need nothing from the target: code writing and editing, math, passage
    requests (reports and explanations) and multi-turn openers."""
    rng = random.Random(seed)
    fns = _std_functions(seed)
    out = []
    for i, (_, _, sig, doc, _) in enumerate(fns[:per_kind]):
        out.append(
            _user(
                f"code_writing-{i}",
                "code_writing",
                f"Write a Python function `{sig.removeprefix('def ')}` that does this: {doc}.",
            )
        )
    for i, (*_, src) in enumerate(fns[per_kind : 2 * per_kind]):
        out.append(
            _user(f"code_editing-{i}", "code_editing", f"{CODE_EDITS[i % len(CODE_EDITS)]}\n\n```python\n{src}\n```")
        )
    for i in range(per_kind):
        out.append(_user(f"math-{i}", "math_reasoning", _math(rng, i)))
    pairs = [(s, e) for s in SUBJECTS for e in EVENTS]
    rng.shuffle(pairs)
    for i, (s, e) in enumerate(pairs[:per_kind]):
        out.append(
            _user(
                f"passage-news-{i}",
                "passage",
                f"Write a short news report (about 120 words) saying that {s} {e}. Invent names, dates and details.",
            )
        )
    for i, t in enumerate(TOPICS):
        out.append(_user(f"passage-explain-{i}", "passage", f"Write one paragraph explaining {t}."))
    for i, a in enumerate(ADVICE):
        out.append(_user(f"multi_turn-{i}", "multi_turn", f"I want to {a}. Where should I start?"))
    return out


def stage_two(answers: list[dict], seed: int = 0) -> list[dict]:
    """Prompts built on the target's stage-1 answers: summaries, passage questions, retrieval
    over three passages, translations of a sentence, and multi-turn follow-ups."""
    rng = random.Random(seed + 1)
    passages = [a["messages"][-1]["content"] for a in answers if a.get("category") == "passage"]
    passages = [p for p in passages if 200 <= len(p) <= 1600]
    out = []
    for i, p in enumerate(passages):
        n = rng.choice(["one sentence", "two sentences", "three bullet points"])
        out.append(_user(f"summarization-{i}", "summarization", f"Summarise this text in {n}.\n\n{p}"))
        q = rng.choice([
            "What is the main point of the passage?", "Who is involved, and what did they do?",
            "What happened, and when?", "What reasons does the passage give?", "What numbers does the passage mention?",
        ])  # fmt: skip
        out.append(_user(f"qa-{i}", "qa", f"Answer the question from the passage.\n\nPassage: {p}\n\nQuestion: {q}"))
        sentence = p.replace("\n", " ").split(". ")[0].strip().rstrip(".") + "."
        if 30 <= len(sentence) <= 300:
            lang = LANGUAGES[i % len(LANGUAGES)]
            out.append(_user(f"translation-{i}", "translation", f"Translate into {lang}: {sentence}"))
    for i in range(len(passages) // 2):
        docs = rng.sample(passages, 3)
        body = "\n".join(f"[{j + 1}] {d}" for j, d in enumerate(docs))
        ask = rng.choice(["What does document {j} report?", "Which document talks about {what}, and what does it say?"])
        j = rng.randint(1, 3)
        what = docs[j - 1].split(". ")[0][:80]
        out.append(_user(
            f"rag-{i}", "rag",
            f"Use only these documents to answer, and name the document you used.\n\nDocuments:\n{body}\n\n"
            f"Question: {ask.format(j=j, what=what)}",
        ))  # fmt: skip
    for a in answers:
        if a.get("category") == "multi_turn":
            follow = FOLLOW_UPS[rng.randrange(len(FOLLOW_UPS))]
            out.append({"id": a["id"] + "-2", "category": "multi_turn",
                        "messages": a["messages"] + [{"role": "user", "content": follow}]})  # fmt: skip
    return out


def check_disjoint(prompts: list[dict], suite: Path = SUITE_PROMPTS) -> None:
    """Raise when a user message of ``prompts`` is one of the suite's (held-out) user messages."""
    held = {
        m["content"].strip()
        for line in suite.read_text(encoding="utf-8").splitlines() if line.strip()
        for m in json.loads(line)["messages"] if m["role"] == "user"
    }  # fmt: skip
    for p in prompts:
        for m in p["messages"]:
            if m["role"] == "user" and m["content"].strip() in held:
                raise ValueError(f"prompt {p['id']} repeats a suite prompt (held out for evaluation).")


def _write(rows: list[dict], out: str) -> None:
    check_disjoint(rows)
    Path(out).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    print(f"{len(rows)} prompts -> {out}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["stage1"] and len(argv) == 2:
        _write(stage_one(), argv[1])
    elif argv[:1] == ["stage2"] and len(argv) == 3:
        answers = [json.loads(x) for x in Path(argv[1]).read_text(encoding="utf-8").splitlines() if x.strip()]
        _write(stage_two(answers), argv[2])
    else:
        print(__doc__.strip().splitlines()[-1])
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
