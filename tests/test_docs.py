"""The README and docs/ stay true: links resolve inside the repository, every flag they name
exists, the CLI reference is regenerated, and the README's fine-tuning quickstart runs."""

from __future__ import annotations

import json
import re
import shlex
from functools import cache
from pathlib import Path

import pytest

from tierlm.cli import build_parser, config_from_args, main
from tierlm.config import check_supported
from tierlm.docs_cli import CLI_DOC, render

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 200


def doc_files(*, results: bool = True) -> list[Path]:
    """README.md and every page under docs/ (docs/results/ holds dated records of
    measurements: their links are checked, the flags they name are history)."""
    pages = sorted(DOCS.rglob("*.md"))
    if not results:
        pages = [p for p in pages if DOCS / "results" not in p.parents]
    return [README, *pages]


# ---- links -----------------------------------------------------------------------------------

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _prose(text: str) -> str:
    """The text with code blocks and code spans removed: a link there is not a link."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def links(text: str) -> list[str]:
    return _LINK.findall(_prose(text))


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lowercased, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _FENCE.sub("", path.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def broken_links(page: Path, text: str | None = None) -> list[str]:
    """What is wrong with each relative link of `page` (its `text`, else the file's)."""
    problems = []
    text = page.read_text(encoding="utf-8") if text is None else text
    for target in links(text):
        if "../shared" in target or "/work/" in target:
            problems.append(f"{target}: points outside the repository (a clone has no ../shared)")
            continue
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.is_relative_to(ROOT):
            problems.append(f"{target}: resolves outside the repository")
        elif not dest.exists():
            problems.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{target}: no heading with the anchor #{anchor} in {dest.name}")
    return problems


@pytest.mark.parametrize("page", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_inside_the_repo(page):
    assert broken_links(page) == []


def test_the_link_checker_catches_what_it_is_for():
    """The checker itself: a missing file, a missing anchor, a link out of the repo; a link in
    code is no link, a URL is not checked."""
    text = ("[a](../missing.md) [b](precision.md#no-such-heading) [c](../../../shared/X.md) "
            "[d](precision.md#auto) [e](https://example.com/x) `[f](nope.md)`")
    problems = broken_links(DOCS / "concepts" / "a-page.md", text)
    assert len(problems) == 3, problems
    assert "no such file" in problems[0] and "#no-such-heading" in problems[1]
    assert "outside the repository" in problems[2]


def test_every_page_is_reachable_from_the_readme():
    """A page no link leads to is a page nobody reads: follow the links from README.md."""
    seen, todo = set(), [README]
    while todo:
        page = todo.pop()
        if page in seen or page.suffix != ".md" or not page.is_file():
            continue
        seen.add(page)
        for target in links(page.read_text(encoding="utf-8")):
            path_part = target.partition("#")[0]
            if path_part and not re.match(r"[a-z][a-z0-9+.-]*:", path_part):
                todo.append((page.parent / path_part).resolve())
    orphans = [str(p.relative_to(ROOT)) for p in doc_files(results=False) if p not in seen]
    assert orphans == []


def test_no_doc_names_the_shared_directory():
    """The design notes under ../shared are not in a clone: the repo's docs never point there."""
    for page in doc_files(results=False):
        text = page.read_text(encoding="utf-8")
        assert "../shared" not in text and "/work/" not in text, page


# ---- flags -----------------------------------------------------------------------------------

_FLAG = re.compile(r"(?<![\w\-/])--[a-zA-Z][\w.\-]*")

# Flags of other programs that the docs show on their own command lines.
_OTHER_PROGRAMS = {"torchrun": {"--nproc-per-node"}}


@cache
def command_flags() -> dict[str, frozenset[str]]:
    """Every option string each `tierlm` subcommand accepts, as argparse has them."""
    parser = build_parser()
    sub = next(a for a in parser._actions if a.choices and "train" in a.choices)
    return {name: frozenset(s for a in p._actions for s in a.option_strings)
            for name, p in sub.choices.items()}


def _blocks(text: str) -> list[tuple[str, str]]:
    """(section heading, paragraph) for every paragraph: a flag of `tierlm probe` is known by
    the command its paragraph or its section names."""
    out, heading = [], ""
    for para in re.split(r"\n\s*\n", text):
        first = para.lstrip().splitlines()[0] if para.strip() else ""
        if first.startswith("#"):
            heading = first
        out.append((heading, para))
    return out


def unknown_flags(text: str) -> list[str]:
    known = command_flags()
    train_or_plan = known["train"] | known["plan"]
    bad = []
    for heading, para in _blocks(text):
        context = heading + "\n" + para
        for flag in _FLAG.findall(para):
            flag = flag.rstrip(".-")
            if flag in train_or_plan:
                continue
            if any(flag in opts and f"tierlm {name}" in context for name, opts in known.items()):
                continue
            if any(prog in para and flag in opts for prog, opts in _OTHER_PROGRAMS.items()):
                continue
            # a benchmark's own flag, on a line that names the benchmark
            scripts = re.findall(r"bench/[\w.]+\.(?:py|sh)", para)
            if any(flag in (ROOT / s).read_text(encoding="utf-8") for s in scripts
                   if (ROOT / s).is_file()):
                continue
            bad.append(flag)
    return bad


@pytest.mark.parametrize("page", doc_files(results=False), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_flag_the_docs_name_exists(page):
    text = page.read_text(encoding="utf-8")
    # The placeholder that stands for any config field (`--section.key VALUE`)
    text = text.replace("--section.key", "")
    assert unknown_flags(text) == []


def test_the_flag_checker_catches_a_flag_that_does_not_exist():
    assert unknown_flags("Train with `tierlm train --max-steps 5 --max-stepz 5`.") == [
        "--max-stepz"]
    # a subcommand's own flag counts only where the doc names that subcommand
    assert unknown_flags("`tierlm plan --json`; `tierlm probe --dir /nvme`") == []
    assert unknown_flags("set --dir /nvme") == ["--dir"]


def doc_commands(page: Path) -> list[list[str]]:
    """The `tierlm train|plan|print-config` command lines in a page's code blocks."""
    out = []
    for block in _FENCE.findall(page.read_text(encoding="utf-8")):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip().removeprefix("$ ")
            if re.match(r"tierlm (train|plan|print-config) ", line):
                out.append(shlex.split(line)[1:])
    return out


@pytest.mark.parametrize("page", doc_files(results=False), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_line_in_the_docs_is_a_valid_config(page):
    """Values too, not only flag names: each shown command resolves and passes the checks
    `tierlm train` makes before any work (a `--resume` line needs its run directory: skipped)."""
    for argv in doc_commands(page):
        if "--resume" in argv:
            continue
        args = build_parser().parse_args(argv)
        cfg = config_from_args(args)
        if argv[0] == "train":
            check_supported(cfg)


# ---- the README ------------------------------------------------------------------------------

def test_readme_is_a_page_not_an_inventory():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move depth to docs/"


def test_readme_names_the_test_command():
    assert "make test" in README.read_text(encoding="utf-8")  # CI and contributors call it


def test_cli_reference_is_current():
    assert CLI_DOC.read_text(encoding="utf-8") == render(), (
        "docs/cli.md is stale: run `python -m tierlm.docs_cli`")


def _quickstart_block() -> str:
    text = README.read_text(encoding="utf-8")
    section = text.split("## Fine-tune on your own data", 1)[1].split("\n## ", 1)[0]
    return re.search(r"^```\n(.*?)^```", section, re.S | re.M).group(1)


# Seconds, not hours: the tiny model, two steps of short rows, no sample, one eval batch.
_TINY = ["--seq-len", "64", "--batch-size", "1", "--grad-accum-steps", "2", "--max-steps", "2",
         "--eval-every", "0", "--train.eval_batches", "1", "--train.sample_tokens", "0",
         "--device", "cpu"]


@pytest.fixture
def tiny_model_and_data(tmp_path):
    """A tiny Llama-family Hugging Face directory with a chat template, and the README's own
    example record written as the data file."""
    from tierlm.data.tokenizer import train_bpe_tokenizer
    from tierlm.models import build_model
    from tierlm.models.testing import tiny_hf_configs

    model = tmp_path / "my-model"
    build_model(tiny_hf_configs(vocab_size=300)["llama_tied_gqa"], seed=0).save_pretrained(model)
    tok = train_bpe_tokenizer(["To be, or not to be, that is the question. " * 40], 300)
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                         "{{ eos_token }}{% endfor %}")
    tok.save_pretrained(model)
    echo = next(line for line in _quickstart_block().splitlines() if line.startswith("echo "))
    record = json.loads(shlex.split(echo)[1])  # the README's record must be valid JSON
    data = tmp_path / "my_data.jsonl"
    data.write_text((json.dumps(record) + "\n") * 200, encoding="utf-8")
    return model, data


def test_readme_quickstart_runs_on_a_tiny_model(tiny_model_and_data, tmp_path, capsys):
    """Every `tierlm` command of the README's fine-tuning quickstart, as written, with the tiny
    model and two steps: the plan fits, full and LoRA fine-tuning write their outputs."""
    model, data = tiny_model_and_data
    commands = [shlex.split(line) for line in _quickstart_block().splitlines()
                if line.startswith("tierlm ")]
    assert [c[1] for c in commands] == ["plan", "train", "train"]
    for argv in commands:
        argv = [{"./my-model": str(model), "my_data.jsonl": str(data)}.get(a, a) for a in argv]
        if "--out" in argv:
            i = argv.index("--out") + 1
            argv[i] = str(tmp_path / argv[i])
        rc = main(argv[1:] + _TINY + (["--no-optimizer-table"] if argv[1] == "plan" else []))
        out, err = capsys.readouterr()
        assert rc == 0, out + err
        if argv[1] == "plan":
            assert "fits. Train with: tierlm train" in out
            continue
        run = Path(argv[argv.index("--out") + 1])
        steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in steps if "loss" in r] == [1, 2]
        assert (run / "hf" / "config.json").is_file()
        if "lora" in argv:
            assert (run / "adapter" / "adapter_config.json").is_file()


@pytest.mark.slow  # plans a 7B model once more per optimizer: about a minute on 2 cores
def test_readme_plan_output_is_what_tierlm_plan_prints(capsys):
    """The README's "Will my model fit?" output is pasted from a real run: every line it shows
    is a line `tierlm plan` prints today (a line cut short with [...] matches up to the cut)."""
    text = README.read_text(encoding="utf-8")
    section = text.split("## Will my model fit?", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"^```\n(.*?)^```", section, re.S | re.M).group(1)
    command, _, shown = block.replace("\\\n", " ").partition("\n")
    assert command.startswith("$ tierlm plan ")
    assert main(shlex.split(command)[2:]) == 0
    printed = capsys.readouterr().out
    for line in shown.splitlines():
        if line.strip() and line != "[...]":
            assert line.split(" [...]")[0] in printed, line
