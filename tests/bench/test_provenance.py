"""Figures are claims (issue 48): every result file says what code it measured, every committed result is
cited by a document, and README quotes only results tied to a commit, with the numbers in their files."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from tests.support.paths import REPO

RESULTS = REPO / "bench" / "results"


def git(repo, *args: str) -> None:
    """git in a scratch repository, as a fixed author."""
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                   capture_output=True)


def result_files() -> list:
    return sorted(p for p in RESULTS.iterdir() if p.is_file())


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.name)
def test_a_result_records_its_commit_or_says_it_cannot(path):
    doc = json.loads(path.read_text())
    assert "commit" in doc and "dirty" in doc, f"{path.name}: no commit/dirty (see bench/runmeta.py)"
    if doc["commit"] is None:
        assert doc.get("provenance"), f"{path.name}: commit unknown and no provenance note"


def _cited(name: str) -> bool:
    found = subprocess.run(["git", "grep", "-q", "-F", name, "--", ":!bench/results"], cwd=REPO)
    return found.returncode == 0


def test_every_committed_result_is_cited():
    tracked = set(subprocess.run(["git", "ls-files", "bench/results"], cwd=REPO, capture_output=True,
                                 text=True).stdout.split())
    files = [p for p in result_files() if f"bench/results/{p.name}" in tracked]
    cited_stems = {p.name.split(".")[0] for p in files if _cited(p.name)}
    orphans = [p.name for p in files
               if p.name.split(".")[0] not in cited_stems
               and not any(p.name.startswith(stem + "-") for stem in cited_stems)]
    assert not orphans, f"results no document cites (cite them or delete them): {orphans}"


def readme_results() -> list[str]:
    return re.findall(r"\(bench/results/([\w.-]+\.json)\)", (REPO / "README.md").read_text())


def test_readme_quotes_only_results_tied_to_a_commit():
    cited = readme_results()
    assert cited, "README cites no result file"
    for name in cited:
        doc = json.loads((RESULTS / name).read_text())
        assert doc["commit"] and doc["dirty"] is False, f"README quotes {name}, not tied to a clean commit"


def test_readme_figures_are_generated_from_their_files():
    """README's table is bench/headline.py's output: edit a figure by hand, or let a result change under
    it, and this fails until `python -m bench.headline --write` is run."""
    from bench import headline

    readme = (REPO / "README.md").read_text()
    assert headline.current(readme) == headline.block(), "README's figures differ from their result files"


def test_bench_readme_lists_every_result_tied_to_a_commit():
    from bench import headline

    text = (REPO / "bench" / "README.md").read_text()
    assert headline.current(text, headline.TIED_BEGIN, headline.TIED_END) == headline.tied_block(), \
        "bench/README.md's list of tied results is stale: run python -m bench.headline --write"


def test_a_headline_refuses_a_result_without_a_clean_commit(tmp_path, monkeypatch):
    from bench import headline

    (tmp_path / "old.json").write_text(json.dumps({"commit": None, "dirty": None, "provenance": "x"}))
    (tmp_path / "dirty.json").write_text(json.dumps({"commit": "abc", "dirty": True}))
    monkeypatch.setattr(headline, "RESULTS", tmp_path)
    for name in ("old.json", "dirty.json"):
        with pytest.raises(ValueError, match="not tied to a clean commit"):
            headline.load(name)


def test_a_run_compiles_petctl_first_as_an_install_would(tmp_path):
    """Under PYTHONDONTWRITEBYTECODE a checkout's agents would each recompile petctl (CPU an installed
    petctl never spends, and the anchor's code never does): a bench's record says it compiled first."""
    from bench import runmeta

    pkg = tmp_path / "petctl"
    pkg.mkdir()
    (pkg / "mod.py").write_text("X = 1\n")
    assert runmeta.compile_petctl(tmp_path)
    assert list((pkg / "__pycache__").glob("mod.*.pyc"))
    (pkg / "bad.py").write_text("def (:\n")
    assert not runmeta.compile_petctl(tmp_path)
    assert "compiled" in runmeta.start(["bench/x.py"])["bytecode"]


def test_the_warm_step_keeps_the_callers_pythonpath(tmp_path, monkeypatch):
    """The agent's `--warm` imports what the agent imports. Where a dependency comes from PYTHONPATH (a
    leased machine's carried packages), replacing PYTHONPATH with the checkout failed the warm step, and
    every agent then compiled its own dataclass methods."""
    from bench import runmeta

    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "carried_dep.py").write_text("VALUE = 1\n")
    tree = tmp_path / "tree"
    (tree / "petctl" / "agent").mkdir(parents=True)
    (tree / "petctl" / "__init__.py").write_text("")
    (tree / "petctl" / "agent" / "__init__.py").write_text("")
    (tree / "petctl" / "agent" / "main.py").write_text("import carried_dep\n")
    monkeypatch.setenv("PYTHONPATH", str(extra))
    assert runmeta.compile_petctl(tree)
    monkeypatch.delenv("PYTHONPATH")
    failures: list[str] = []
    assert not runmeta.compile_petctl(tree, failures)
    # The record says which cache stayed cold, and why: a run on a leased machine cannot be asked later.
    assert len(failures) == 1 and failures[0].startswith("the agent's cache: ModuleNotFoundError"), failures


def test_the_cli_cache_is_warmed_as_a_first_run_would(tmp_path, monkeypatch):
    """P6 times `petctl --help` as a user's later runs feel it. Under PYTHONDONTWRITEBYTECODE no run saves
    the CLI's dataclass cache, so the bench writes it first, or every timed start would compile."""
    from bench import runmeta

    tree = tmp_path / "tree"
    for pkg in ("petctl", "petctl/agent", "petctl/cli", "petctl/io"):
        (tree / pkg).mkdir(parents=True, exist_ok=True)
        (tree / pkg / "__init__.py").write_text("")
    shutil.copy(REPO / "petctl" / "io" / "methodcache.py", tree / "petctl" / "io" / "methodcache.py")
    (tree / "petctl" / "agent" / "main.py").write_text("")
    (tree / "petctl" / "cli" / "group.py").write_text(
        "import dataclasses\n\n@dataclasses.dataclass\nclass Opts:\n    n: int = 0\n")
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    assert runmeta.compile_petctl(tree)
    assert list((tree / "petctl" / "__pycache__").glob("dataclass-methods.cli.*.marshal"))


def test_dirty_means_a_tracked_file_changed_and_untracked_files_are_listed(tmp_path):
    """A run's own log redirected into the checkout must not mark it dirty (git describe --dirty's rule),
    but a changed tracked file must; the untracked paths are listed so a reader can judge."""
    from bench import runmeta

    git(tmp_path, "init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    git(tmp_path, "add", "code.py")
    git(tmp_path, "commit", "-qm", "c")
    state = runmeta.git_state(tmp_path)
    assert state["dirty"] is False and state["untracked"] == []
    (tmp_path / "run log.txt").write_text("bench output\n")  # a space: one path, not two
    state = runmeta.git_state(tmp_path)
    assert state["dirty"] is False and state["untracked"] == ["run log.txt"]
    (tmp_path / "code.py").write_text("x = 2\n")
    assert runmeta.git_state(tmp_path)["dirty"] is True


def test_a_trace_headline_reads_the_run_of_its_boot_and_refuses_another():
    from bench.headline import _trace

    def run(boot: float, goodput: float, lost: float) -> dict:
        return {"boot_s": boot, "systems": {"petctl": {"summary": {"mean": {
            "goodput_scaled": goodput, "steps_lost": lost}}}}}

    several = {"results": {"t-boot90": run(90, 0.95, 0), "t-boot180": run(180, 0.93, 2)}}
    assert _trace("t", "petctl")(several) == "95.0 %, 0 steps lost"
    assert _trace("t", "petctl", 180)(several) == "93.0 %, 2 steps lost"
    assert _trace("t", "petctl")({"results": {"t": run(90, 0.972, 1)}}) == "97.2 %, 1 step lost"
    with pytest.raises(ValueError, match="180"):
        _trace("t", "petctl")({"results": {"t": run(180, 0.93, 0)}})


def test_a_failed_run_is_found_wherever_it_is_recorded_so_its_logs_are_kept():
    from bench.run import run_errors

    results = {"P5": {"runs": {"petctl/N=64": [{"rdzv_s": 2.9}],
                               "torchrun-c10d/N=64": [{"error": "not every worker ran within 420 s"}]}},
               "spot-10-15": {"systems": {"petctl": {"error": "timeout", "errors": ["x"]}}}}
    assert run_errors(results) == ["not every worker ran within 420 s", "timeout"]
    assert run_errors({"P5": {"runs": {"petctl/N=64": [{"rdzv_s": 2.9, "error": None}]}}}) == []


def test_the_installed_python_imports_petctl_and_its_dependencies_without_the_editable_finder(tmp_path):
    import subprocess

    from bench.petctl_runner import REPO, node_env
    from bench.runmeta import installed_python

    python = installed_python(tmp_path / "python")
    assert installed_python(tmp_path / "python") == python  # made once
    probe = ("import sys, petctl; from petctl.io.store import v3, v3wire; import hpack, torch; "
             "print(petctl.__file__); print(any('editable' in m for m in sys.modules))")
    out = subprocess.run([python, "-c", probe], env=node_env(), capture_output=True, text=True, timeout=120,
                         check=True).stdout.split()
    assert out == [str(REPO / "petctl" / "__init__.py"), "False"]


def test_a_tree_copied_without_git_reads_the_senders_state_and_sees_a_change(tmp_path):
    """The device machine gets the tree without .git: the result must still name the commit, and say
    dirty when a tracked file changed after the state was sent."""
    from bench import runmeta

    src, copy = tmp_path / "src", tmp_path / "copy"
    src.mkdir()

    git(src, "init", "-q")
    (src / "code.py").write_text("x = 1\n")
    git(src, "add", "code.py")
    git(src, "commit", "-qm", "c")
    head = runmeta.git_state(src)["commit"]
    runmeta.send_state(src)
    copy.mkdir()
    for name in ("code.py", runmeta.SENT_STATE):
        (copy / name).write_bytes((src / name).read_bytes())
    state = runmeta.git_state(copy)
    assert state["commit"] == head and state["dirty"] is False and "match" in state["git_state_from"]
    (copy / "code.py").write_text("x = 2\n")
    state = runmeta.git_state(copy)
    assert state["commit"] == head and state["dirty"] is True and "DIFFER" in state["git_state_from"]
    (copy / runmeta.SENT_STATE).unlink()
    assert runmeta.git_state(copy)["commit"] is None


def test_a_matching_sent_state_outranks_an_older_git_there(tmp_path):
    """The device machine keeps the session's first .git under a later tree: git there names an older
    commit and calls the tree dirty. The sent state, whose digest matches, names the code that ran."""
    from bench import runmeta

    git(tmp_path, "init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    git(tmp_path, "add", "code.py")
    git(tmp_path, "commit", "-qm", "old")
    old = runmeta.git_state(tmp_path)["commit"]
    (tmp_path / "code.py").write_text("x = 2\n")
    git(tmp_path, "commit", "-qam", "new")
    runmeta.send_state(tmp_path)
    new = runmeta.git_state(tmp_path)["commit"]
    git(tmp_path, "reset", "-q", "--soft", old)  # git now names the old commit, with code.py changed
    state = runmeta.git_state(tmp_path)
    assert state["commit"] == new != old and state["dirty"] is False
    (tmp_path / "code.py").write_text("x = 3\n")  # the tree moved on: git's answer stands
    state = runmeta.git_state(tmp_path)
    assert state["commit"] == old and state["dirty"] is True
