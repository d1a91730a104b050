"""The sandbox command-line builders, without running anything: every limit is passed on, the writable areas are
mounted before the read-only paths, nothing the command or its environment holds can break out of its quoting."""

from __future__ import annotations

import shlex
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from services.harness.sandbox_argv import (
    HostPath,
    bwrap_argv,
    command_env,
    confined,
    docker_run_argv,
    rlimit_args,
    unshare_argv,
    with_relay,
)
from services.harness.sandbox_spec import GYRE_RUN_DIR, Bind, SandboxLimits

STATE = Path("/srv/gyre/executions/e1")
limit_values = st.one_of(st.none(), st.integers(min_value=1, max_value=2**40))
limits = st.builds(SandboxLimits, cpu_seconds=limit_values, memory_bytes=limit_values, max_processes=limit_values,
                   file_size_bytes=limit_values, open_files=limit_values)
# Anything a command line or an environment value can hold (no NUL: exec refuses it).
text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40)
argvs = st.lists(text, min_size=1, max_size=6)
envs = st.dictionaries(st.from_regex(r"[A-Z_][A-Z0-9_]{0,10}", fullmatch=True), text, max_size=5)

OPTION_OF = {"cpu_seconds": "cpu", "memory_bytes": "data", "max_processes": "nproc", "file_size_bytes": "fsize",
             "open_files": "nofile"}


@given(limits)
def test_every_set_limit_becomes_one_prlimit_option_and_no_unset_one_does(chosen: SandboxLimits) -> None:
    args = rlimit_args(chosen)
    assert args[0] == "prlimit" and args[-1] == "--"
    for field, option in OPTION_OF.items():
        value = getattr(chosen, field)
        given_options = [a for a in args if a.startswith(f"--{option}=")]
        assert given_options == ([] if value is None else [f"--{option}={value}"])


@given(limits, argvs)
def test_a_confined_command_drops_privileges_before_its_limits_and_runs_unchanged(chosen: SandboxLimits,
                                                                                  argv: list[str]) -> None:
    full = confined(argv, uid=61001, limits=chosen)
    assert full[0] == "setpriv" and "--reuid=61001" in full and "--no-new-privs" in full
    assert full.index("setpriv") < full.index("prlimit")
    assert full[-len(argv):] == argv


@given(argvs)
def test_the_relay_starts_first_and_the_command_runs_as_its_own_arguments(argv: list[str]) -> None:
    wrapped = with_relay(argv)
    assert wrapped[:2] == ["sh", "-c"] and f"{GYRE_RUN_DIR}/relay.py" in wrapped[2]
    assert wrapped[4:] == argv  # passed as "$@", never spliced into the shell text


def test_the_commands_own_environment_wins_over_the_spec_and_the_defaults() -> None:
    env = command_env(python_bin="/venv/bin", base={"HOME": "/spec-home", "A": "spec"}, extra={"A": "command"})
    assert env["PATH"].startswith("/venv/bin:") and env["HOME"] == "/spec-home" and env["A"] == "command"
    assert env["TMPDIR"] == "/tmp"


def _bwrap(ro_paths: list[HostPath], binds: list[Bind], env: dict[str, str], *, gateway: bool = False,
           shm_bytes: int | None = 1024) -> list[str]:
    return bwrap_argv(["true"], state_dir=STATE, workdir="/app", ro_paths=ro_paths, binds=binds, gateway=gateway,
                      env=env, cwd="/app", shm_bytes=shm_bytes)


def test_bwrap_mounts_the_writable_areas_before_any_read_only_path() -> None:
    """A read-only path under an area (a virtualenv under /tmp) must land on top of the area, not under it."""
    args = _bwrap([HostPath(path="/usr"), HostPath(path="/tmp/venv")], [], {})
    area_binds = [i for i, a in enumerate(args) if a == "--bind"]
    ro_binds = [i for i, a in enumerate(args) if a == "--ro-bind"]
    assert [args[i + 2] for i in area_binds] == ["/app", "/tmp", "/home/agent"]
    assert max(area_binds) < min(ro_binds)
    assert args[area_binds[0] + 1] == str(STATE / "work")


def test_bwrap_recreates_a_relative_link_and_binds_through_an_absolute_one() -> None:
    args = _bwrap([HostPath(path="/bin", link="usr/bin"), HostPath(path="/opt/py", link="/usr/lib/py")], [], {})
    assert ["--symlink", "usr/bin", "/bin"] == args[args.index("--symlink"):args.index("--symlink") + 3]
    assert "/opt/py" in args[args.index("--ro-bind"):]


def test_bwrap_sizes_dev_shm_only_when_it_can_and_binds_the_gateway_route_only_when_asked() -> None:
    assert "--size" not in _bwrap([], [], {}, shm_bytes=None)
    sized = _bwrap([], [], {}, shm_bytes=4096)
    assert sized[sized.index("--size") + 1] == "4096" and sized[sized.index("--size") + 2] == "--tmpfs"
    assert GYRE_RUN_DIR not in _bwrap([], [], {})
    routed = _bwrap([], [], {}, gateway=True)
    assert routed[routed.index(GYRE_RUN_DIR) - 2:routed.index(GYRE_RUN_DIR) + 1] == [
        "--ro-bind", str(STATE / ".run"), GYRE_RUN_DIR]


@given(envs)
def test_bwrap_clears_the_environment_and_sets_exactly_the_commands(env: dict[str, str]) -> None:
    args = _bwrap([], [], env)
    cleared = args.index("--clearenv")
    pairs = [(args[i + 1], args[i + 2]) for i in range(cleared, len(args)) if args[i] == "--setenv"]
    assert dict(pairs) == env and len(pairs) == len(env)


def test_bwrap_makes_every_missing_parent_traversable_once() -> None:
    args = _bwrap([HostPath(path="/root/venv/lib")], [Bind(host=Path("/host/t"), inside="/root/venv/share")], {})
    made = [args[i + 3] for i, a in enumerate(args) if a == "--perms" and args[i + 2] == "--dir"]
    assert made.count("/root") == 1 and made.count("/root/venv") == 1
    assert made.index("/root") < made.index("/root/venv")


@given(argvs, envs, text)
def test_unshare_quotes_the_command_environment_and_directory_so_the_shell_reads_them_back(
    argv: list[str], env: dict[str, str], cwd_tail: str
) -> None:
    cwd = "/app/" + cwd_tail
    args = unshare_argv(argv, state_dir=STATE, workdir="/app", ro_paths=[], binds=[], gateway=False, env=env,
                        cwd=cwd, shm_bytes=1024)
    assert args[:2] == ["unshare", "--mount"] and args[-3:-1] == ["sh", "-c"]
    script = args[-1]
    words = shlex.split(script[script.index('exec chroot "$R"'):])  # the last line, however many lines it spans
    assert words[:5] == ["exec", "chroot", "$R", "/usr/bin/env", "-i"]
    assert words[5:5 + len(env)] == [f"{k}={v}" for k, v in env.items()]
    inner = words[5 + len(env):]
    assert inner[:2] == ["sh", "-c"] and len(inner) == 3
    command = shlex.split(inner[2])
    assert command[:4] == ["cd", cwd, "&&", "exec"] and command[4:] == argv


def test_unshare_mounts_areas_first_links_relative_paths_and_remounts_binds_read_only() -> None:
    script = unshare_argv(["true"], state_dir=STATE, workdir="/app", ro_paths=[HostPath(path="/bin", link="usr/bin"),
                          HostPath(path="/usr")], binds=[Bind(host=Path("/h/tests"), inside="/tests", read_only=False),
                          Bind(host=Path("/h/setup.sh"), inside="/task/setup.sh")], gateway=True, env={}, cwd="/app",
                          shm_bytes=2048)[-1]
    lines = script.splitlines()
    assert lines.index(f'mount --bind {STATE / "home"} "$R"/home/agent') < lines.index('mount --rbind /usr "$R"/usr')
    assert 'ln -s usr/bin "$R"/bin' in lines
    assert 'mount -o remount,bind,ro "$R"/tests' not in lines
    assert 'mount -o remount,bind,ro "$R"/task/setup.sh' in lines
    assert f'mount -o remount,bind,ro "$R"{GYRE_RUN_DIR}' in lines
    assert any("size=2048" in line for line in lines)


@given(limits, envs)
def test_docker_runs_without_network_or_capabilities_within_the_limits_and_keeps_the_images_path(
    chosen: SandboxLimits, env: dict[str, str]
) -> None:
    args = docker_run_argv(["true"], image="img", container="gyre-e1-000001", labels={"gyre.sandbox-root": "/srv"},
                           uid=61002, limits=chosen, state_dir=STATE, workdir="/app", binds=[], gateway=False,
                           env={**env, "PATH": "/venv/bin:/usr/bin"}, cwd="/app")
    assert args[args.index("--network") + 1] == "none" and args[args.index("--cap-drop") + 1] == "ALL"
    assert args[args.index("--user") + 1] == "61002:61002" and "--read-only" in args
    assert args[args.index("--label") + 1] == "gyre.sandbox-root=/srv"
    assert ("--pids-limit" in args) == (chosen.max_processes is not None)
    assert ("--memory" in args) == (chosen.memory_bytes is not None)
    assert (f"data={chosen.memory_bytes}" in args) == (chosen.memory_bytes is not None)
    assert args[args.index("--shm-size") + 1] == str(chosen.shm_bytes)
    passed = [args[i + 1] for i, a in enumerate(args) if a == "-e"]
    assert passed == [f"{k}={v}" for k, v in env.items() if k != "PATH"]
    assert args[-3:] == ["/app", "img", "true"]
