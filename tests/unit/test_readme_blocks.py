"""The README test's own logic (tests/e2e/readme_blocks.py): blocks are found, what the README
shows beside a command is read as its expected output and matched loosely but not vacuously, and
a block nobody accounts for is reported."""

from __future__ import annotations

from tests.e2e.readme_blocks import (
    loose, printed_differently, readme_blocks, shown_output, unaccounted, unmatched
)

README = '''# Title

```bash
make up   # runs in the foreground
```

Text.

```bash
curl -X POST 'http://127.0.0.1:8000/api/v1/models?dry_run=true'
# {"fits": true, "placement": {"worker_id": "...", ...},
#  "worker_name": "myhost"}
.venv/bin/shoal models list   # an inline comment is not output
```

```python
print(len(v), n)   # 384 18
print(out.text)    # The capital of <country> is Paris.
x = 1  # not a print
```

```
shoal: ready
```
'''


def test_blocks_and_what_they_show() -> None:
    blocks = readme_blocks(README)
    assert [(b.lang, b.line) for b in blocks] == [("bash", 3), ("bash", 9), ("python", 16),
                                                  ("", 22)]
    assert shown_output(blocks[0]) == []
    assert shown_output(blocks[1]) == [
        '{"fits": true, "placement": {"worker_id": "...", ...},\n"worker_name": "myhost"}']
    assert shown_output(blocks[2]) == ["384 18", "The capital of <country> is Paris."]


def test_loose_matching_keeps_what_is_not_a_wildcard() -> None:
    said = shown_output(readme_blocks(README)[1])
    real = ('{"fits": true, "placement": {"worker_id": "ab12", "gpu_indexes": []}, '
            '"worker_name": "vm"}')
    assert unmatched(said, real, {"myhost": "vm"}) is None
    assert unmatched(said, real.replace("true", "false"), {"myhost": "vm"}) == said[0]
    assert unmatched(said, real) == said[0]  # the host name differs unless it is said to vary
    assert loose("ready in <t>s", one_line=True).fullmatch("ready in 7.4s")
    assert not loose("ready in <t>s", one_line=True).fullmatch("ready in 7.4s, worker vm")


def test_a_python_block_prints_exactly_the_lines_shown() -> None:
    said = shown_output(readme_blocks(README)[2])
    assert printed_differently(said, "384 18\nThe capital of France is Paris.\n") is None
    assert "384 20" in str(printed_differently(["384 20"], "384 18\n"))
    # a print of several lines where the README shows one is a difference
    assert printed_differently(["Paris."], "Copied.\n\nParis.\n") is not None
    assert printed_differently([], "anything\n") is None  # nothing shown: nothing to compare


def test_a_block_nobody_accounts_for_is_reported() -> None:
    blocks = readme_blocks(README)
    markers = ["make up", "dry_run=true", "print(len(v), n)", "shoal: ready"]
    assert unaccounted(blocks, markers) == []
    added = readme_blocks(README + "\n```bash\n.venv/bin/shoal new-command\n```\n")
    [problem] = unaccounted(added, markers)
    assert "line 26" in problem and "new-command" in problem
    assert unaccounted(blocks, markers[:3] + ["gone"])  # an entry whose block was removed
    assert unaccounted(blocks, [markers[1], markers[0], *markers[2:]])  # out of order
    assert unaccounted(blocks, ["shoal", *markers[1:]])  # one marker in two blocks
