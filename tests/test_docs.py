"""The documentation's runnable examples run."""

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_python_api_diloco_examples_run():
    """Every python block of docs/python-api.md after the signature (the DiLoCo examples) runs."""
    text = (DOCS / "python-api.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    examples = [b for b in blocks if "import muloco" in b and "Trainer" not in b]
    assert len(examples) == 2
    for example in examples:
        exec(compile(example, "docs/python-api.md", "exec"), {"__name__": "docs_example"})
