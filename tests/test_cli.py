import json

import pytest

from domainfm import cli, hub

COMMANDS = ["list", "info", "download", "pretrain", "finetune", "evaluate", "predict", "export"]


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(([command] if command else []) + ["--help"])
    assert exc.value.code == 0
    assert "usage: domainfm" in capsys.readouterr().out


def test_list_and_info(tiny_zoo, capsys):
    assert cli.main(["list", "dfmtest-*"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["dfmtest-small", "dfmtest-tiny"]
    assert cli.main(["info", "dfmtest-small"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["name"] == "dfmtest-small" and info["num_params"] == sum(
        p.numel() for p in tiny_zoo.Net(hidden=16).parameters())


def test_download_verifies_and_caches(tiny_zoo, http_server, tmp_path, capsys):
    import hashlib
    import io

    import torch

    buf = io.BytesIO()
    torch.save(tiny_zoo.state_dict(), buf)
    body = buf.getvalue()
    url = http_server.serve("/w/tiny.pth", body)
    tiny_zoo.register("dfmtest-dl", weights=[hub_source(url, hashlib.sha256(body).hexdigest())])
    assert cli.main(["download", "dfmtest-dl"]) == 0
    cached = hub.cache_path_for(url)
    assert cached.read_bytes() == body
    assert str(cached) in capsys.readouterr().out


def hub_source(url, digest):
    from domainfm import WeightSource

    return WeightSource(url, sha256=digest)


def test_unknown_family_is_named():
    with pytest.raises(SystemExit, match="no finetune entry for family 'nosuchfamily'"):
        cli.main(["finetune", "nosuchfamily"])


def test_evaluate_rejects_non_run_folder(tmp_path, capsys):
    assert cli.main(["evaluate", str(tmp_path)]) == 2
    assert "not a domainfm run folder" in capsys.readouterr().err


def test_overrides_may_follow_options(monkeypatch, tmp_path):
    seen = {}

    def fake_run(kind, args):
        seen.update(kind=kind, overrides=args.overrides, runs_dir=args.runs_dir, name=args.name)
        return 0

    monkeypatch.setattr(cli, "_run_family", fake_run)
    assert cli.main(["finetune", "fam", "a.b=1", "--runs-dir", str(tmp_path), "c=2", "--name", "r1", "d.e=[1, 2]"]) == 0
    assert seen == {"kind": "finetune", "overrides": ["a.b=1", "c=2", "d.e=[1, 2]"], "runs_dir": str(tmp_path), "name": "r1"}
    with pytest.raises(SystemExit):
        cli.main(["finetune", "fam", "--runs-dir", str(tmp_path), "--bogus"])


# --------------------------------------------------------------------------- global flags, precision


class _ToyApply:
    """A stand-in ``domainfm.finetune.dfmclitoy`` whose predict/embed record their argv and fail
    with a user error (a missing input file), and whose finetune ``run`` does the same."""

    def __init__(self, monkeypatch, tmp_path):
        import sys
        import types
        from dataclasses import dataclass, field

        from domainfm.engine import TrainConfig

        @dataclass
        class Config:
            train: TrainConfig = field(default_factory=TrainConfig)

        self.calls: list[tuple[str, list[str]]] = []
        module = types.ModuleType("domainfm.finetune.dfmclitoy")
        module.Config = Config
        module.run = lambda cfg, run_dir: self._fail("run", [cfg.train.precision])
        module.predict_main = lambda argv: self._fail("predict", argv)
        module.embed_main = lambda argv: self._fail("embed", argv)
        monkeypatch.setitem(sys.modules, "domainfm.finetune.dfmclitoy", module)
        self.config = tmp_path / "toy.yaml"
        self.config.write_text("train: {max_epochs: 1}\n")
        self.runs = tmp_path / "runs"

    def _fail(self, what, argv):
        self.calls.append((what, list(argv)))
        raise FileNotFoundError(f"no such input for {what}")

    def argv(self, command: str) -> list[str]:
        if command in ("predict", "embed"):
            return [command, "dfmclitoy", "--model", "m", "--input", "in.x", "--output", "out.x"]
        return [command, "dfmclitoy", "--config", str(self.config), "--runs-dir", str(self.runs)]


@pytest.fixture
def toy_apply(monkeypatch, tmp_path):
    monkeypatch.delenv("DOMAINFM_DEBUG", raising=False)
    monkeypatch.delenv("DOMAINFM_PRECISION", raising=False)
    return _ToyApply(monkeypatch, tmp_path)


@pytest.mark.parametrize("command", ["predict", "embed", "finetune"])
@pytest.mark.parametrize("where", [0, 1, 2, -1])
def test_debug_is_recognised_anywhere_for_every_subcommand(toy_apply, command, where, capsys):
    argv = toy_apply.argv(command)
    # without --debug: one line and the hint, exit 2; the family got its own arguments only
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"domainfm {command}: error: no such input for {'run' if command == 'finetune' else command}",
                   cli._DEBUG_HINT]
    # with --debug before the command, after it, after FAMILY or at the very end: the traceback
    debug_argv = list(argv)
    debug_argv.insert(len(argv) if where == -1 else where, "--debug")
    with pytest.raises(FileNotFoundError, match="no such input"):
        cli.main(debug_argv)
    first, second = toy_apply.calls
    assert first == second  # --debug never reaches the family's own parser
    if command != "finetune":
        assert second == (command, argv[2:])


def test_debug_after_double_dash_belongs_to_the_family(toy_apply, capsys):
    assert cli.main(["predict", "dfmclitoy", "--", "--debug"]) == 2  # not a traceback: no --debug for us
    assert toy_apply.calls == [("predict", ["--debug"])]


@pytest.mark.parametrize("command", ["list", "info", "download", "evaluate"])
def test_debug_is_accepted_after_the_other_subcommands(tiny_zoo, command, tmp_path, capsys):
    argv = {"list": ["list", "dfmtest-*"], "info": ["info", "dfmtest-small"],
            "download": ["download", "dfmtest-small"], "evaluate": ["evaluate", str(tmp_path)]}[command]
    expected = cli.main(argv)
    plain = capsys.readouterr()
    assert cli.main([*argv, "--debug"]) == expected
    assert capsys.readouterr() == plain  # same output: --debug is not an argument of the command


def test_unknown_model_is_a_one_line_user_error(capsys):
    assert cli.main(["info", "dfmtest-nosuch"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("domainfm info: error: Unknown model 'dfmtest-nosuch'. `domainfm.list_models()` lists the ")
    assert err[1:] == [cli._DEBUG_HINT]
    from domainfm.zoo import UnknownModelError

    with pytest.raises(UnknownModelError, match="dfmtest-nosuch"):
        cli.main(["--debug", "info", "dfmtest-nosuch"])


ALLOWED = "(allowed: auto, 32-true, bf16-mixed, bf16-true, 16-mixed, 64-true)"


@pytest.mark.parametrize("command", ["predict", "embed", "finetune"])
@pytest.mark.parametrize("form", [["--precision", "fp8"], ["--precision=fp8"]])
def test_bad_precision_option_is_one_line_exit_2(toy_apply, command, form, capsys):
    assert cli.main([*toy_apply.argv(command), *form]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"domainfm {command}: error: argument --precision: invalid value 'fp8' {ALLOWED}"]
    assert toy_apply.calls == []  # refused before the family is called or a run folder made
    assert not toy_apply.runs.exists()


def test_good_precision_reaches_the_family(toy_apply, capsys):
    assert cli.main([*toy_apply.argv("predict"), "--precision", "bf16-mixed"]) == 2  # the toy's missing input
    assert cli.main([*toy_apply.argv("finetune"), "--precision", "bf16-mixed"]) == 2
    assert toy_apply.calls[0] == ("predict", [*toy_apply.argv("predict")[2:], "--precision", "bf16-mixed"])
    assert toy_apply.calls[1] == ("run", ["bf16-mixed"])  # --precision P is train.precision=P


def test_bad_precision_in_config_override_or_environment_is_one_line(toy_apply, monkeypatch, capsys):
    assert cli.main([*toy_apply.argv("finetune"), "train.precision=fp8"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("domainfm finetune: error: train.precision='fp8': expected one of")
    assert err[0].endswith("(set in override 'train.precision=fp8')")
    monkeypatch.setenv("DOMAINFM_PRECISION", "fp8")
    for command in ("predict", "embed", "finetune"):
        assert cli.main(toy_apply.argv(command)) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"domainfm {command}: error: environment variable DOMAINFM_PRECISION='fp8': invalid value {ALLOWED}"]
    assert toy_apply.calls == []
    assert cli.main(["list", "dfmtest-nothing"]) == 0  # commands that compute nothing do not care


def test_precision_refused_inside_a_family_is_a_user_error(toy_apply, monkeypatch, capsys):
    """A value that escapes the CLI's own check (here passed by the family itself) is refused by
    resolve_precision: one line, exit 2; other ValueErrors stay tracebacks."""
    import sys

    from domainfm.precision import resolve_precision

    sys.modules["domainfm.finetune.dfmclitoy"].predict_main = lambda argv: resolve_precision("fp16")
    assert cli.main(toy_apply.argv("predict")) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["domainfm predict: error: precision='fp16': expected one of ('auto', '32-true', 'bf16-mixed', "
                   "'bf16-true', '16-mixed', '64-true')", cli._DEBUG_HINT]

    def other(argv):
        raise ValueError("a bug, not the user's input")

    sys.modules["domainfm.finetune.dfmclitoy"].predict_main = other
    with pytest.raises(ValueError, match="a bug"):
        cli.main(toy_apply.argv("predict"))


def test_bad_precision_through_the_console_entry(tmp_path):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("DOMAINFM_DEBUG", "DOMAINFM_PRECISION")}
    done = subprocess.run([sys.executable, "-m", "domainfm.cli", "embed", "cbramod", "--model", "cbramod-test",
                           "--input", str(tmp_path / "x.edf"), "--output", str(tmp_path / "o.npz"),
                           "--precision", "fp8"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**env, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == f"domainfm embed: error: argument --precision: invalid value 'fp8' {ALLOWED}"
    assert "Traceback" not in done.stderr and list(tmp_path.iterdir()) == []


def test_config_takes_a_shipped_name_a_file_and_refuses_a_folder(tmp_path, capsys):
    from domainfm import config as cfgmod

    assert cli._config_file("fim", "pretrain", "pretrain_synthetic_prior") == cfgmod.config_path(
        "fim", "pretrain_synthetic_prior")
    assert cli._config_file("fim", "pretrain", None) == cfgmod.config_path("fim", "pretrain")
    mine = tmp_path / "mine.yaml"
    mine.write_text("model: {name: fim-imputation-test}\n")
    assert cli._config_file("fim", "pretrain", str(mine)) == mine
    with pytest.raises(cfgmod.ConfigError, match="no shipped config fim/nosuch.yaml.*pretrain_synthetic_prior"):
        cli._config_file("fim", "pretrain", "nosuch")
    assert cli.main(["pretrain", "fim", "--config", str(tmp_path), "--runs-dir", str(tmp_path / "runs")]) == 2
    assert "is a folder" in capsys.readouterr().err
    # a shipped name wins over a folder of that name in the working directory (a stage naming
    # `pretrain` run from the repository root, where pretrain/ is a folder)
    (tmp_path / "pretrain").mkdir()
    import os

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert cli._config_file("fim", "pretrain", "pretrain") == cfgmod.config_path("fim", "pretrain")
    finally:
        os.chdir(cwd)


def test_the_console_script_prints_user_notices_on_one_line():
    import subprocess
    import sys

    code = ("import sys, warnings; from domainfm import cli; sys.argv = ['domainfm', 'list', 'nothing-*']; "
            "warnings.warn('x.edf: truncated EDF file'); cli.main(); warnings.warn('x.edf: channel T3 dropped')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    # before main() the default two-line format; from the console script on, one line per notice
    assert lines[-1] == "warning: x.edf: channel T3 dropped", done.stderr
    assert any("UserWarning: x.edf: truncated EDF file" in line for line in lines[:-1])
