"""The documentation's runnable examples run."""

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_python_api_diloco_example_runs():
    text = (DOCS / "python-api.md").read_text()
    example = re.findall(r"```python\n(.*?)```", text, flags=re.S)[0]
    exec(compile(example, "docs/python-api.md", "exec"), {})
