"""The shape the suite keeps: the library never imports the command line, the
login-node commands start no MPI, and every link and docs reference resolves."""

import argparse
import ast
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from hpcjobs.cli import COMMANDS, _parser_for, parse_error

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hpcjobs"
LIBRARY = sorted(p for p in PACKAGE.rglob("*.py")
                 if "cli" not in p.relative_to(PACKAGE).parts and p.name != "__main__.py")  # __main__: the CLI's door
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _imports(path: Path) -> set[str]:
    """The absolute names of the modules ``path`` imports (relative imports resolved)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names |= {module} | {f"{module}.{a.name}" for a in node.names}
    return names


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_library_never_imports_the_command_line(path):
    cli = {n for n in _imports(path) if n == "hpcjobs.cli" or n.startswith("hpcjobs.cli.")}
    assert not cli, f"{path.relative_to(ROOT)} imports {sorted(cli)}"


def _python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=ROOT).stdout.strip()


def test_the_collectives_load_no_argparse():
    names = ", ".join(n for n in __import__("hpcjobs.collectives").collectives.__all__)
    assert _python(f"import sys; from hpcjobs.collectives import {names}; print('argparse' in sys.modules)") \
        == "False"


def test_help_and_the_login_node_commands_start_no_mpi(tmp_path):
    """Every command's --help, and slurm render with a job's arguments (which
    builds that command's parser to check them), leave mpi4py.MPI unimported,
    and torch too: they answer at once."""
    runs = [["--help"], *([*c.words, "--help"] for c in COMMANDS),
            ["slurm", "render", "train", "--cpu", "--", "--epochs", "2", "--algorithm", "ring"],
            ["slurm", "render", "allreduce", "--", "--max-bytes", "1M", "--impl", "all"],
            ["slurm", "render", "tune", "--", "--bogus"]]
    code = f"""
import contextlib, io, sys
from hpcjobs.cli import main
codes = []
for argv in {runs!r}:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            codes.append(main(argv))
        except SystemExit as e:
            codes.append(e.code)
print(codes, 'mpi4py.MPI' in sys.modules, 'torch' in sys.modules)
"""
    out = _python(code)
    assert out == f"{[0] * (len(runs) - 3) + [0, 0, 2]} False False", out


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _headings(path: Path) -> list[str]:
    return [line.lstrip("#").strip() for line in path.read_text().splitlines() if re.match(r"#{1,6} ", line)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    for target in _LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        assert file.exists(), f"{doc.relative_to(ROOT)}: {target} does not exist"
        if anchor:
            assert anchor in {_slug(h) for h in _headings(file)}, f"{doc.relative_to(ROOT)}: no heading #{anchor}"


# A reference to the docs from the code: "docs/x.md, "Heading"" (or README.md).
_REFERENCE = re.compile(r"(README(?:\.md)?|docs/[\w/.-]+\.md)`*,? \(?\"([^\"]+)\"")
_MENTION = re.compile(r"\b(README(?:\.md)?|docs/[\w/.-]+\.md)")
CODE = sorted([ROOT / "pyproject.toml", ROOT / ".ci" / "run"] + [
    p for d in ("hpcjobs", "scripts", "slurm", "tests") for p in (ROOT / d).rglob("*")
    if p.is_file() and p.suffix in (".py", ".sh", ".sbatch") and p.name != "test_shape.py"])


@pytest.mark.parametrize("path", CODE, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_docs_reference_in_the_code_names_an_existing_heading(path):
    text = re.sub(r"\s+#\s*|\s+", " ", path.read_text())  # joins comment and docstring lines
    for doc in _MENTION.findall(text):
        assert (ROOT / ("README.md" if doc.startswith("README") else doc)).exists(), f"{path}: no {doc}"
    for doc, heading in _REFERENCE.findall(text):
        file = ROOT / ("README.md" if doc.startswith("README") else doc)
        assert heading in _headings(file), f"{path.relative_to(ROOT)}: {doc} has no heading {heading!r}"


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_is_over_400_lines(path):
    assert len(path.read_text().splitlines()) <= 400


def test_the_public_names_import():
    """The public surface docs/design.md lists, and the console script."""
    from hpcjobs.collectives import (ALGORITHMS, DTYPES, MESSAGE_ALGORITHMS, OPS, allreduce,  # noqa: F401
                                     chunk_bounds, hierarchical_allreduce, parameter_server_allreduce,
                                     rabenseifner_allreduce, recursive_doubling_allreduce, ring_allgather,
                                     ring_allgatherv, ring_allreduce, ring_reduce_scatter, shm_allgather,
                                     shm_allreduce, shm_reduce_scatter, symmetric_empty, symmetric_free,
                                     tree_allreduce)
    from hpcjobs.compression import (BF16Compressor, ErrorFeedback, FP16Compressor,  # noqa: F401
                                     NoneCompressor, PowerSGDCompressor, QSGDCompressor, RandomKCompressor,
                                     SignCompressor, TopKCompressor, compressed_allreduce)
    from hpcjobs.topology import detect  # noqa: F401
    from hpcjobs.training import (DistributedOptimizer, TrainConfig, broadcast_optimizer_state,  # noqa: F401
                                  broadcast_parameters, schedule, train)
    from hpcjobs import ddp_hooks  # noqa: F401
    from hpcjobs.horovod import torch as hvd
    from hpcjobs.torch_backend import new_process_group  # noqa: F401
    from hpcjobs.training.resnet import resnet18, resnet50  # noqa: F401
    from hpcjobs.training.gpt import GPT, GPTConfig, gpt, lm_loss  # noqa: F401
    assert callable(hvd.DistributedOptimizer) and callable(ddp_hooks.register)

    import hpcjobs
    import hpcjobs.collectives
    assert hpcjobs.allreduce is hpcjobs.collectives.allreduce and callable(hpcjobs.world)
    assert set(hpcjobs.collectives.__all__) >= {"allreduce", "ring_allreduce", "symmetric_empty"}
    assert 'hpcjobs = "hpcjobs.cli:main"' in (ROOT / "pyproject.toml").read_text()


def test_a_lazily_exported_name_is_a_plain_attribute_after_its_first_use():
    """``hc.allreduce(x)`` in a loop must not resolve the name on every call
    (the package's ``__getattr__`` costs about 2 us, as much as a small
    allreduce)."""
    out = _python("import hpcjobs.collectives as hc; f = hc.oneshot_allreduce; "
                  "print('oneshot_allreduce' in vars(hc), hc.oneshot_allreduce is f)")
    assert out.split() == ["True", "True"]


def test_the_readme_is_a_guide_of_at_most_300_lines():
    # What is more (flags, results, the doors' details) belongs in docs/.
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


# `hpcjobs ...` in a fenced block of the docs: up to a shell operator, a
# redirection or a comment; `\` continuations joined.
_FENCE = re.compile(r"^[ \t]*```[\w-]*\n(.*?)^[ \t]*```", re.S | re.M)  # in list items too
_SHELL_END = {"|", "||", "&&", ";", "&", "<"}
# What may stand in front of `hpcjobs` on a command line: a launcher and its flags.
_LAUNCHERS = ("mpirun", "mpiexec", "srun", "timeout", "python", "python3", "env")


def _documented_commands(doc: Path):
    """(line, argv after ``hpcjobs``) of every hpcjobs command in ``doc``'s code blocks."""
    text = doc.read_text()
    for block in _FENCE.finditer(text):
        first = text[:block.start()].count("\n") + 2
        lines = block.group(1).split("\n")
        k = 0
        while k < len(lines):
            start, line = k, lines[k]
            while line.endswith("\\") and k + 1 < len(lines):
                k += 1
                line = line[:-1] + " " + lines[k].strip()
            k += 1
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue  # an unclosed quote: not a shell line
            for i, word in enumerate(words):
                if word.rsplit("/", 1)[-1] != "hpcjobs" or i + 1 == len(words):
                    continue
                launched = words[0].rsplit("/", 1)[-1] in _LAUNCHERS or words[0].endswith("_cluster.sh")
                if not (i == 0 or words[i - 1] == "--" or words[i - 1] in _SHELL_END or launched):
                    continue  # "from hpcjobs import ...", a path in prose
                argv = []
                for w in words[i + 1:]:
                    if w in _SHELL_END or w.startswith((">", "2>", "1>")):
                        break
                    argv.append(w)
                if argv:
                    yield first + start, argv


def _known_flags(argv: list[str]) -> set[str] | None:
    """Every option string ``hpcjobs ARGV``'s command accepts (and the global ones), or None: no command."""
    command, parser, _ = _parser_for(argv)
    if command is None:
        return None
    flags = {o for a in parser._actions for o in a.option_strings}
    for word in command.words:
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[word]
    return flags | {o for a in parser._actions for o in a.option_strings}


_PLACEHOLDER = re.compile(r"\$|<|\.\.\.|…|\[")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_documented_command_parses(doc):
    """A command the docs show is one the CLI takes: it parses as written
    (argparse's flags, types and choices), or, where it holds a shell
    variable or a placeholder, every --flag in it is one its command has.
    What follows ``--`` is the job's (``slurm render/submit/launch``)."""
    problems = []
    for line, argv in _documented_commands(doc):
        argv = argv[:argv.index("--")] if "--" in argv else argv
        where = f"{doc.relative_to(ROOT)}:{line}: hpcjobs {' '.join(argv)}"
        if any(_PLACEHOLDER.search(a) for a in argv):
            flags = _known_flags([a for a in argv if not _PLACEHOLDER.search(a)])
            if flags is None:
                problems.append(f"{where}: no such command")
                continue
            for a in argv:
                flag = a.strip("[]").split("=")[0]
                if flag.startswith("--") and flag not in flags:
                    problems.append(f"{where}: no flag {flag}")
        elif (error := parse_error(argv)) is not None:
            problems.append(f"{where}: {error}")
    assert not problems, "\n".join(problems)


def test_the_docs_show_commands_the_test_above_reads():
    """Guards the reader itself: a broken fence pattern would pass every doc
    with nothing checked. 71 commands when written."""
    assert sum(1 for doc in DOCS for _ in _documented_commands(doc)) >= 71
