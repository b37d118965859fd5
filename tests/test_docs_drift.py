"""The documentation against the code it describes: tables that cannot drift, links that resolve.

- every relative link (and `#anchor`) in README.md and docs/ resolves;
- each algorithm page's config tables list exactly the fields of the algorithm's config dataclass,
  each with its default;
- the README's algorithm table lists exactly the registry's algorithms, each linking its page;
- the README's fast-path table names only `python -m inference` flags that exist, and every flag a
  fast path adds is in it;
- every figure of a table marked `<!-- figures: results/X.json -->` (or results directories, or
  several, space-separated) is a number of those results, to the precision shown: a rerun that changes the result fails the table
  until it is updated.
"""
from __future__ import annotations

import dataclasses
import pathlib
import re

import yaml

from algorithms import config_schemas

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


# ----------------------------------------------------------------------------- markdown helpers


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", page.read_text(), flags=re.M)}


def links(page: pathlib.Path) -> list[str]:
    """Relative link targets of a page, outside code blocks."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def tables(text: str, first_header: str) -> list[list[list[str]]]:
    """Every markdown table whose header row starts with `| first_header |`: rows of cells."""
    found, rows = [], None
    for line in text.splitlines():
        if line.startswith(f"| {first_header} |"):
            rows = []
            found.append(rows)
        elif rows is not None and line.startswith("|"):
            if not line.startswith("|---"):
                rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        else:
            rows = None
    return found


def documented_defaults(page: pathlib.Path) -> dict[str, str]:
    """key -> default cell of every `| key | default | ... |` table of a page. A cell that names several
    keys (`a` / `b`) gives each the default cell; keys of other groups (`trainer.lr`) are left out."""
    out = {}
    for table in tables(page.read_text(), "key"):
        for row in table:
            for key in re.findall(r"`([^`]+)`", row[0]) or [row[0]]:
                if "." not in key:
                    out[key] = row[1]
    return out


def same_default(cell: str, value) -> bool:
    """A table's default cell (YAML, in backticks or not) equals the dataclass default."""
    text = cell.strip().strip("`")
    try:
        parsed = yaml.safe_load(text)
    except yaml.YAMLError:
        parsed = text
    if isinstance(value, (list, tuple)):
        return isinstance(parsed, list) and list(parsed) == list(value)
    if isinstance(value, bool) or value is None:
        return parsed is value
    if isinstance(value, (int, float)):
        return isinstance(parsed, (int, float)) and not isinstance(parsed, bool) and float(parsed) == float(value)
    return str(parsed) == str(value)


def field_default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    return field.default_factory()  # type: ignore[misc]


# ----------------------------------------------------------------------------- the tests


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in links(page):
            path, _, anchor = target.partition("#")
            dest = (page.parent / path) if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_algorithm_pages_list_every_config_key_with_its_default():
    problems = []
    for name, schema in config_schemas().items():
        page = ROOT / "docs" / f"{name}.md"
        documented = documented_defaults(page)
        fields = {f.name: field_default(f) for f in dataclasses.fields(schema)}
        for key in sorted(set(fields) - set(documented)):
            problems.append(f"docs/{name}.md lacks algo.{key}")
        for key in sorted(set(documented) - set(fields)):
            problems.append(f"docs/{name}.md lists algo.{key}, which {schema.__name__} does not have")
        for key in sorted(set(fields) & set(documented)):
            if not same_default(documented[key], fields[key]):
                problems.append(f"docs/{name}.md: algo.{key} default {documented[key]} != {fields[key]!r}")
    assert not problems, "\n".join(problems)


def readme_table(first_header: str) -> list[list[str]]:
    [table] = tables((ROOT / "README.md").read_text(), first_header)
    return table


def test_readme_algorithm_table_is_the_registry():
    rows = readme_table("`+algo=`")
    listed = [row[0].strip("`") for row in rows]
    assert listed == list(config_schemas()), "README's algorithm table differs from algorithms.REGISTRY"
    for name, row in zip(listed, rows):
        assert f"(docs/{name}.md)" in row[-1], f"README: {name}'s row does not link docs/{name}.md"


def cli_flags(module: str = "__main__") -> set[str]:
    source = (ROOT / "inference" / f"{module}.py").read_text()
    return set(re.findall(r'(?:add_argument|p\.add_argument)\(\s*"(--[a-z-]+)"', source))


def test_readme_names_only_real_cli_flags_and_every_fast_path_flag():
    flags = cli_flags()
    readme = (ROOT / "README.md").read_text()
    server_lines = [line for line in readme.splitlines() if "python -m inference.server" in line]
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]+)", "\n".join(server_lines)))
    assert named and not named - cli_flags("server"), f"README names server flags it lacks: {sorted(named - cli_flags('server'))}"
    inference_lines = [line for line in readme.splitlines()
                       if "python -m inference" in line and "python -m inference.server" not in line]
    fast_paths = "\n".join(" | ".join(row) for row in readme_table("fast path"))
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]+)", "\n".join(inference_lines) + fast_paths))
    assert not named - flags, f"README names flags python -m inference does not have: {sorted(named - flags)}"
    # the flags that select a fast path (the rest tune one: --draft-len, --confidence, --pic-mode, ...)
    for flag in ("--speculative", "--drafter", "--adapter", "--artifacts", "--skip-mode"):
        assert flag in flags and flag in fast_paths, f"README's fast-path table lacks {flag}"


def test_docs_index_lists_every_page():
    index = (ROOT / "docs" / "README.md").read_text()
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name != "README.md")
    missing = [name for name in pages if f"]({name}" not in index]
    assert not missing, f"docs/README.md does not link {missing}"


PRODUCT = ("algorithms", "inference", "models", "tasks", "trainer")


def test_the_tree_names_every_module():
    text = (ROOT / "docs" / "architecture.md").read_text()
    tree = text.split("## The tree", 1)[1].split("```")[1]
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", tree))
    missing = []
    for package in PRODUCT:
        assert f"{package}/" in tree, package
        for path in (ROOT / package).rglob("*.py"):
            stem = path.parent.name if path.stem == "__init__" else path.stem
            if stem not in words and stem not in PRODUCT:
                missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"docs/architecture.md's tree does not name {missing}"


# docs/architectures.md's summary rows -> the support matrix's architectures they stand for
FAMILIES = {
    "Llama, Qwen2, Qwen3": ("llama", "qwen2", "qwen3"),
    "Llama with scaled RoPE": ("llama-rope-linear", "mistral-swa", "phi3", "gemma", "gemma2", "gemma3-text"),
    "Qwen2-MoE, Qwen3-MoE, Mixtral": ("qwen2-moe", "qwen3-moe", "mixtral"),
    "OLMo-2": ("olmo2",),
    "GPT-NeoX, GPT-2": ("gpt-neox", "gpt2"),
}


def test_the_architecture_summary_is_the_measured_support_matrix():
    """Each cell of docs/architectures.md's table says what benchmarks/support_matrix.py measured for
    every architecture of that row (results/support_matrix.json), and every measured one has a row."""
    import json

    measured = {row["arch"]: {k: v["verdict"].split()[0] for k, v in row["cells"].items()}
                for row in json.loads((ROOT / "docs" / "results" / "support_matrix.json").read_text())["rows"]}
    [table] = tables((ROOT / "docs" / "architectures.md").read_text(), "architecture")
    header = "| architecture | sft, grpo, opsd, mass, tesd, clm | seed | qad | skipper | attuner | runtime paths |"
    assert header in (ROOT / "docs" / "architectures.md").read_text()
    columns = [("sft", "grpo", "opsd", "mass", "tesd", "clm"), ("seed",), ("qad",), ("skipper",), ("attuner",)]
    covered, problems = set(), []
    for row in table:
        [family] = [f for f in FAMILIES if row[0].startswith(f)]
        for arch in FAMILIES[family]:
            covered.add(arch)
            for cell, algos in zip(row[1:6], columns):
                for algo in algos:
                    if measured[arch][algo] != cell:
                        problems.append(f"{family} says {algo} {cell}; {arch} measured {measured[arch][algo]}")
    assert not problems, "\n".join(problems)
    assert covered == set(measured), f"architectures measured but not in the table: {sorted(set(measured) - covered)}"


# ----------------------------------------------------------------------------- tables drawn from results

FIGURES_MARK = re.compile(r"^<!-- figures: (\S+(?: \S+)*) -->$", flags=re.M)
NUMBER = re.compile(r"(?<![\w.\d])([-−]?)(\d+(?:\.\d+)?(?:e[-+]?\d+)?)(%?)")


def result_numbers(obj) -> list[float]:
    """Every number in a result's JSON, numeric keys and strings included."""
    if isinstance(obj, bool):
        return []
    if isinstance(obj, (int, float)):
        return [float(obj)]
    if isinstance(obj, dict):
        return [x for k, v in obj.items() for x in result_numbers(k) + result_numbers(v)]
    if isinstance(obj, list):
        return [x for v in obj for x in result_numbers(v)]
    if isinstance(obj, str):
        try:
            return [float(obj)]
        except ValueError:
            return []
    return []


def marked_tables(text: str) -> list[tuple[str, list[str]]]:
    """(result path, the body rows of the table right after the mark) for each figures mark."""
    out = []
    for m in FIGURES_MARK.finditer(text):
        lines = text[m.end():].lstrip("\n").splitlines()
        table = []
        for line in lines:
            if not line.startswith("|"):
                break
            table.append(line)
        out.append((m.group(1), [r for r in table[1:] if not r.startswith("|---")]))
    return out


def unmatched_figures(rows: list[str], numbers: list[float]) -> list[str]:
    """The figures of `rows` (every cell but the first, the row's label) that no result number rounds
    to at the shown precision (a percentage may also be a fraction)."""
    missing = []
    for row in rows:
        for cell in row.strip().strip("|").split("|")[1:]:
            for sign, digits, pct in NUMBER.findall(cell.replace("**", "")):
                mantissa, _, exponent = digits.partition("e")
                shown = len(mantissa.split(".")[1]) if "." in mantissa else 0
                value, tol = float(digits) * (-1 if sign else 1), 0.5 * 10 ** (int(exponent or 0) - shown) * (1 + 1e-9)
                targets = [value, value / 100] if pct else [value]
                if not any(abs(x - t) <= tol * (0.01 if t != value else 1) for x in numbers for t in targets):
                    missing.append(f"{sign}{digits}{pct} in {cell.strip()!r}")
    return missing


def test_tables_marked_as_drawn_from_results_match_them():
    import json

    checked = 0
    for page in PAGES:
        for target, rows in marked_tables(page.read_text()):
            files = []
            for name in target.split():
                path = (page.parent / name).resolve()
                assert path.exists(), f"{page.relative_to(ROOT)}: figures mark names {name}, which does not exist"
                files += sorted(path.rglob("*.json")) if path.is_dir() else [path]
            numbers = [x for f in files for x in result_numbers(json.loads(f.read_text()))]
            assert rows, f"{page.relative_to(ROOT)}: figures mark for {target} has no table after it"
            missing = unmatched_figures(rows, numbers)
            assert not missing, f"{page.relative_to(ROOT)}: figures not in {target}: {missing[:5]}"
            checked += 1
    assert checked >= 1


def test_a_stale_figure_is_caught():
    rows = ["| SEED | 0.76 | **1.76x** | 48% |"]
    assert unmatched_figures(rows, [0.76, 1.7604, 0.481]) == []
    assert unmatched_figures(["| pic | 3.8e-4 (0.999) |"], [0.000384, 0.9991]) == []
    assert unmatched_figures(["| pic | 3.8e-4 (0.999) |"], [0.000394, 0.9991]) == ["3.8e-4 in '3.8e-4 (0.999)'"]
    assert unmatched_figures(rows, [0.76, 1.74, 0.481]) == ["1.76 in '**1.76x**'"]
    assert unmatched_figures(rows, [0.76, 1.76, 0.47]) == ["48% in '48%'"]
    # a sign is part of the figure: −0.010 is not 0.010 (an interval's lower end, a loss)
    assert unmatched_figures(["| d | +0.035 [−0.010, +0.080] |"], [0.035, -0.01, 0.08]) == []
    assert unmatched_figures(["| d | +0.035 [−0.010, +0.080] |"], [0.035, 0.01, 0.08]) == ["−0.010 in '+0.035 [−0.010, +0.080]'"]
    assert unmatched_figures(["| lr | 1e-3 |"], [0.001]) == []
