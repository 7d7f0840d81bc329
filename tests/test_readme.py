"""The README and docs as a new user reads them in a clone: links resolve inside the repository, the
install section names the extras, and the README's examples do what their comments say."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from ops_transformer import launch

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


@pytest.mark.parametrize("doc", [README, *sorted((ROOT / "docs").glob("*.md"))],
                         ids=lambda p: p.name)
def test_relative_links_resolve_inside_the_repository(doc):
    prose = re.sub(r"```.*?```|`[^`\n]*`", "", doc.read_text(), flags=re.S)  # not code
    for target in LINK.findall(prose):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (doc.parent / target.split("#")[0]).resolve()
        assert path.is_relative_to(ROOT), f"{doc.name}: {target} points outside the repository"
        assert path.exists(), f"{doc.name}: {target} does not exist"


def test_install_section_names_the_hf_extra_and_how_to_run_the_command():
    text = README.read_text()
    install = text[text.index("## Install"):text.index("## Use")]
    assert '".[hf]"' in install and "transformers" in install
    assert ".venv/bin/ops-transformer" in text and "source .venv/bin/activate" in text


def _record_rows(code: str):
    """Run the README's second example on this rank, recording the batches the model sees."""
    import ops_transformer as ot

    seen = []
    forward = ot.GPT.forward

    def recording(self, idx, targets=None):
        seen.append(idx.tolist())
        return forward(self, idx, targets)

    ot.GPT.forward = recording  # this forked rank only
    namespace = {"__name__": "readme"}  # not "__main__": the example's own launch stays idle
    exec(code, namespace)
    namespace["train"](steps=2)
    return int(os.environ["RANK"]), seen


def test_readme_data_parallel_example_feeds_each_rank_its_own_rows():
    first, second = _python_blocks(README.read_text())[:2]
    assert 'if __name__ == "__main__":' in first and 'if __name__ == "__main__":' in second
    seen = dict(launch(_record_rows, 4, first + "\n" + second, timeout=120))
    # tp fastest: ranks 0, 1 are dp rank 0; ranks 2, 3 are dp rank 1
    assert seen[0] == seen[1] and seen[2] == seen[3], "a TP group must see the same rows"
    for step in range(2):
        dp0, dp1 = seen[0][step], seen[2][step]
        assert len(dp0) == len(dp1) == 4  # the global batch of 8 split in two
        assert not set(map(tuple, dp0)) & set(map(tuple, dp1)), "dp ranks share rows"
