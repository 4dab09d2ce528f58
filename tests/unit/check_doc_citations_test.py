#!/usr/bin/env python3
"""scripts/check-doc-citations on small trees: the citation forms the repository uses pass when
their file and section exist, and each kind of broken citation is reported with its file and
line (run by ctest as check_doc_citations_test)."""
import pathlib
import subprocess
import sys
import tempfile
import textwrap
import unittest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "check-doc-citations"

GUIDE = textwrap.dedent("""\
    # The guide
    ## 1. The math
    ### 1.2 Shapes
    ## The CUDA backend (server/backend/cuda)
    ## The GEMM library: oneDNN behind the CPU backend
    ### `bench`
    **The compute team** (2026-12-03). Helpers that spin.

    ```sh
    # Not a heading
    ```
    """)

GOOD = textwrap.dedent("""\
    // docs/guide.md, "The guide"; docs/guide.md, "The math"; docs/guide.md §1; docs/guide.md, §1.2
    // docs/guide.md, "The CUDA backend" and docs/guide.md, "The CUDA backend (server/backend/cuda)"
    // docs/guide.md, "The GEMM library"; docs/guide.md, "bench"; docs/guide.md, "The compute
    // team"; docs/guide.md,
    // "Shapes"; docs/other.md; proto/pkg/api.proto
    const char* kMessage = "see docs/guide.md, \\"The CUDA "
                           "backend\\")";
    """)


class CheckDocCitationsTest(unittest.TestCase):
    def run_on(self, files: dict) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory() as root:
            tree = {"docs/guide.md": GUIDE, "docs/other.md": "# Other\n", "proto/pkg/api.proto": "",
                    "server/good.h": GOOD}
            tree.update(files)
            for name, text in tree.items():
                path = pathlib.Path(root, name)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text, encoding="utf-8")
            return subprocess.run([sys.executable, str(SCRIPT), root], capture_output=True, text=True)

    def test_every_form_that_exists_passes(self):
        result = self.run_on({})
        self.assertEqual(result.stdout, "")
        self.assertEqual(result.returncode, 0, result.stderr)

    def test_each_broken_citation_is_reported(self):
        broken = textwrap.dedent("""\
            See docs/guide.md, "Drain" and docs/missing.md for this.
            Also docs/guide.md §3.2, and docs/guide.md, "Not a heading" (inside a code block),
            docs/guide.md, "The GEMM" (a prefix is not the title), docs/guide.md, "the math" (case),
            and `proto/pkg/attnserve.proto`. A wrapped one: docs/guide.md, "The compute
            crew".
            """)
        result = self.run_on({"README.md": broken, "client/x.py": '# docs/guide.md,\n# "Drain"\n'})
        self.assertEqual(result.returncode, 1)
        self.assertEqual(result.stdout.splitlines(), [
            'client/x.py:1: docs/guide.md, "Drain": no such heading in docs/guide.md',
            'README.md:4: proto/pkg/attnserve.proto: no such file',
            'README.md:1: docs/guide.md, "Drain": no such heading in docs/guide.md',
            'README.md:1: docs/missing.md: no such file',
            'README.md:2: docs/guide.md §3.2: no heading numbered 3.2 in docs/guide.md',
            'README.md:2: docs/guide.md, "Not a heading": no such heading in docs/guide.md',
            'README.md:3: docs/guide.md, "The GEMM": no such heading in docs/guide.md',
            'README.md:3: docs/guide.md, "the math": no such heading in docs/guide.md',
            'README.md:4: docs/guide.md, "The compute crew": no such heading in docs/guide.md',
        ])


if __name__ == "__main__":
    unittest.main()
