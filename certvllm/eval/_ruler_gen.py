"""Run NVIDIA RULER's synthetic generators offline (in a child process of ``certvllm eval``).

    python -m certvllm.eval._ruler_gen JOBS.json

``JOBS.json``: ``{"root": UNPACKED_WHEEL, "jobs": [{"script": "niah.py", "argv": [...], "replace": [[old,
new], ...]}, ...]}``. Each job runs the generator script as ``__main__`` with its own ``sys.argv``, as
RULER's ``prepare.py`` would, with one change: nltk's ``sent_tokenize`` (which needs the ``punkt`` data
download) is replaced by a regular-expression sentence splitter. ``replace`` edits the script's source
before it runs (used for QA below 4K tokens, where RULER's search step of 10 documents never fits and
its sample loop would spin forever).
"""

from __future__ import annotations

import json
import re
import runpy
import sys
from pathlib import Path


def _sent_tokenize(text: str, language: str = "english") -> list[str]:
    return re.split(r"(?<=[.!?])\s+", text)


def main(jobs_file: str) -> None:
    spec = json.loads(Path(jobs_file).read_text())
    root = Path(spec["root"])
    synthetic = root / "long_context_eval" / "data" / "synthetic"
    import nltk.tokenize

    nltk.tokenize.sent_tokenize = _sent_tokenize
    sys.path[:0] = [str(root), str(synthetic.parent), str(synthetic)]
    for job in spec["jobs"]:
        script = synthetic / job["script"]
        sys.argv = [str(script), *job["argv"]]
        if not job.get("replace"):
            runpy.run_path(str(script), run_name="__main__")
            continue
        source = script.read_text()
        for old, new in job["replace"]:
            if old not in source:
                raise RuntimeError(f"{script.name}: {old!r} not found; the RULER version differs")
            source = source.replace(old, new)
        exec(compile(source, str(script), "exec"), {"__name__": "__main__", "__file__": str(script)})


if __name__ == "__main__":
    main(sys.argv[1])
