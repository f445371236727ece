"""The README's Python example runs as written."""

import re

from speed.paths import repo_root


def test_readme_python_blocks_run():
    text = (repo_root() / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "the README has no python example"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})
