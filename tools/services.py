#!/usr/bin/env python3
"""Throwaway PostgreSQL 15, MariaDB and Redis servers for tests and benchmarks.

Each server runs on a free loopback port inside a fresh temporary directory
and is stopped (and the directory removed) afterwards.

Command line::

    python tools/services.py install
    python tools/services.py run [--pg] [--mysql] [--redis] [--durable] [--dir DIR] -- CMD [ARGS...]

``run`` starts the selected services (all three when none is selected),
runs CMD with these variables added to its environment, stops the services
and exits with CMD's exit status:

* ``DS_PG_URL=postgres://durable:PASSWORD@127.0.0.1:PORT/durable``
* ``DS_MYSQL_URL=mysql://durable:PASSWORD@127.0.0.1:PORT/durable``
* ``DS_REDIS_URL=redis://127.0.0.1:PORT/0``

By default the database servers trade durability for speed, which the tests
do not need: PostgreSQL runs with ``fsync``, ``synchronous_commit`` and
``full_page_writes`` off, MariaDB with ``innodb_flush_log_at_trx_commit=2``
and the doublewrite buffer off, so a commit waits for no flush to disk.
``--durable`` (``durable=True`` in the Python API) starts them with the
servers' durable defaults instead (PostgreSQL: all three on; MariaDB:
``innodb_flush_log_at_trx_commit=1``, doublewrite on), as a production
deployment runs them; the benchmark (``bench/run``) uses it.

Python API::

    with services(pg=True, mysql=False, redis=True) as env:   # durable=True: flushes on
        os.environ.update(env)

    svc = start_postgres(tmp_path)   # also start_mariadb, start_redis; durable=True
    try:
        ...  # use svc.url
    finally:
        svc.stop()

When run as root, PostgreSQL and MariaDB run as the ``postgres`` and
``mysql`` system users (created if missing); the directory given to the
``start_*`` functions must be traversable by them.  Servers are started in
their own session (so a terminal's Ctrl-C reaches only the command) and get
a parent-death signal, so they go away even if the process that started
them is killed with SIGKILL.  That signal fires when the *thread* that
started a server exits: start them from a thread that outlives them.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PG_BIN = Path("/usr/lib/postgresql/15/bin")
DB_NAME = "durable"
DB_USER = "durable"
APT_PACKAGES = (
    "postgresql-15",
    "redis-server",
    "mariadb-server",
    "libmariadb-dev",
    "pkg-config",
    "chromium",
    "spin",  # the model check of the turn protocol (tools/model)
)
START_TIMEOUT = 60.0
STOP_TIMEOUT = 15.0
PORT_ATTEMPTS = 3
POLL_INTERVAL = 0.05

_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)


class ServiceError(RuntimeError):
    """A service could not be set up, started or made ready."""


@dataclass
class Service:
    """A running server process and how to reach it."""

    name: str
    url: str
    process: subprocess.Popen[bytes]
    log: Path
    stop_signal: signal.Signals = signal.SIGTERM
    _stopped: bool = field(default=False, repr=False)
    _relaunch: Callable[[], subprocess.Popen[bytes]] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        """Process id of the server (also its process group id)."""
        return self.process.pid

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Stop the server: its stop signal, then SIGKILL to its whole group.

        Safe to call more than once.
        """
        if not self._stopped:
            self._stopped = True
            _terminate(self.process, self.stop_signal, timeout)

    def restart(self, timeout: float = STOP_TIMEOUT) -> None:
        """Stop the server and start it again on the same data and port;
        return once it accepts connections. Clients see their connections drop.

        Raises ServiceError if this service cannot be restarted.
        """
        if self._relaunch is None:
            raise ServiceError(f"{self.name} cannot be restarted")
        _terminate(self.process, self.stop_signal, timeout)
        self.process = self._relaunch()
        self._stopped = False


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def _tail(path: Path, lines: int = 40) -> str:
    """Return the last ``lines`` lines of a text file ('' if missing)."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _terminate(process: subprocess.Popen[bytes], stop_signal: signal.Signals, timeout: float) -> None:
    """Send ``stop_signal``, wait, then SIGKILL the process's whole group.

    The process must lead its own process group (``start_new_session``).
    """
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(stop_signal)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            print(
                f"services: pid {process.pid} ignored {stop_signal.name} for {timeout:.0f}s, killing it",
                file=sys.stderr,
            )
    # Leftover children (e.g. PostgreSQL backends) are in the same group.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ensure_user(name: str) -> pwd.struct_passwd:
    """Return the system user ``name``, creating it when missing."""
    try:
        return pwd.getpwnam(name)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--user-group", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
            check=True,
        )
        return pwd.getpwnam(name)


def _service_dir(root: Path, name: str, user: str) -> tuple[Path, dict[str, Any]]:
    """Create ``root/name`` for a server and return it with Popen user kwargs.

    As root the directory is handed to ``user`` and the kwargs switch to it;
    otherwise everything runs as the current user.
    """
    path = Path(root) / name
    path.mkdir(mode=0o700)
    if os.geteuid() != 0:
        return path, {}
    account = _ensure_user(user)
    os.chown(path, account.pw_uid, account.pw_gid)
    return path, {
        "user": account.pw_uid,
        "group": account.pw_gid,
        "extra_groups": os.getgrouplist(account.pw_name, account.pw_gid),
    }


def _server_env(home: Path) -> dict[str, str]:
    """A small, predictable environment for server processes."""
    return {
        "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
        "HOME": str(home),
        "LANG": "C.UTF-8",
    }


def _die_with_parent(sig: signal.Signals) -> Callable[[], None]:
    """Popen preexec_fn: deliver ``sig`` to the child when the parent thread dies."""
    return lambda: _LIBC.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def _run_logged(cmd: Sequence[str | os.PathLike[str]], log: Path, **kwargs: Any) -> None:
    """Run a short setup command, appending its output to ``log``."""
    with log.open("ab") as out:
        try:
            result = subprocess.run(
                [os.fspath(c) for c in cmd],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=START_TIMEOUT,
                check=False,
                **kwargs,
            )
        except subprocess.TimeoutExpired:
            raise ServiceError(f"timed out: {cmd[0]}\n{_tail(log)}") from None
    if result.returncode != 0:
        raise ServiceError(f"{os.path.basename(cmd[0])} exited with {result.returncode}\n{_tail(log)}")


def _succeeds(cmd: Sequence[str | os.PathLike[str]]) -> bool:
    """Run a quick probe command; True if it exits 0."""
    try:
        return (
            subprocess.run(
                [os.fspath(c) for c in cmd],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=10,
                check=False,
            ).returncode
            == 0
        )
    except subprocess.TimeoutExpired:
        return False


def _launch(
    name: str,
    build_cmd: Callable[[int], list[str]],
    log: Path,
    is_ready: Callable[[int], bool],
    *,
    stop_signal: signal.Signals,
    popen_kwargs: dict[str, Any],
) -> tuple[subprocess.Popen[bytes], int]:
    """Start a server on a free port and wait until ``is_ready(port)``.

    ``is_ready`` should probe the server's private Unix socket: the servers
    create it only after binding the TCP port, so a success cannot come from
    another server that happens to hold the port.

    Retries with another port when the chosen one was taken meanwhile
    (e.g. by a concurrent run).  Raises ServiceError with the log tail on
    failure; no process is left running then.
    """
    for _ in range(PORT_ATTEMPTS):
        port = _free_port()
        log_size = log.stat().st_size if log.exists() else 0
        with log.open("ab") as out:
            process = subprocess.Popen(
                build_cmd(port),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent(stop_signal),
                **popen_kwargs,
            )
        deadline = time.monotonic() + START_TIMEOUT
        while process.poll() is None and time.monotonic() < deadline:
            if is_ready(port):
                return process, port
            time.sleep(POLL_INTERVAL)
        reason = (
            f"did not become ready in {START_TIMEOUT:.0f}s"
            if process.poll() is None
            else f"exited with {process.returncode}"
        )
        _terminate(process, stop_signal, STOP_TIMEOUT)
        with log.open("rb") as f:
            f.seek(log_size)
            if b"Address already in use" not in f.read():
                raise ServiceError(f"{name} {reason}; log {log}:\n{_tail(log)}")
    raise ServiceError(f"{name}: no free port after {PORT_ATTEMPTS} attempts\n{_tail(log)}")


def _relauncher(
    name: str,
    build_cmd: Callable[[int], list[str]],
    port: int,
    log: Path,
    is_ready: Callable[[int], bool],
    *,
    stop_signal: signal.Signals,
    popen_kwargs: dict[str, Any],
) -> Callable[[], subprocess.Popen[bytes]]:
    """Return a function that starts the server again on the same ``port`` and
    data and waits until ``is_ready(port)`` (used by :meth:`Service.restart`)."""

    def relaunch() -> subprocess.Popen[bytes]:
        with log.open("ab") as out:
            again = subprocess.Popen(
                build_cmd(port),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent(stop_signal),
                **popen_kwargs,
            )
        deadline = time.monotonic() + START_TIMEOUT
        while not is_ready(port):
            if again.poll() is not None or time.monotonic() > deadline:
                _terminate(again, stop_signal, STOP_TIMEOUT)
                raise ServiceError(f"{name} did not restart; log {log}:\n{_tail(log)}")
            time.sleep(POLL_INTERVAL)
        return again

    return relaunch


# --------------------------------------------------------------------------
# Servers
# --------------------------------------------------------------------------


def start_postgres(root: Path, *, durable: bool = False) -> Service:
    """Start PostgreSQL 15 under ``root/postgres``.

    The superuser ``durable`` (password auth) owns database ``durable``;
    ``pg_stat_statements`` is preloaded and created in ``durable`` and in
    ``template1`` (so databases created later have it too).

    ``durable``: False (the tests' default) runs with ``fsync``,
    ``synchronous_commit`` and ``full_page_writes`` off: a commit flushes
    nothing. True keeps PostgreSQL's defaults (all three on), as a deployment runs.
    """
    if not (PG_BIN / "postgres").exists():
        raise ServiceError(f"{PG_BIN}/postgres not found; run: services.py install")
    base, as_user = _service_dir(root, "postgres", "postgres")
    data, sockets, log = base / "data", base / "sockets", base / "server.log"
    sockets.mkdir()
    password = secrets.token_hex(16)
    pwfile = base / "pwfile"
    pwfile.write_text(password + "\n")
    if as_user:
        os.chown(sockets, as_user["user"], as_user["group"])
        os.chown(pwfile, as_user["user"], as_user["group"])
    env = _server_env(base)
    _run_logged(
        [
            PG_BIN / "initdb",
            "-D",
            data,
            "-U",
            DB_USER,
            f"--pwfile={pwfile}",
            "--auth=scram-sha-256",
            "--encoding=UTF8",
            "--locale=C.UTF-8",
            "--no-sync",
            "--no-instructions",
        ],
        log,
        cwd=base,
        env=env,
        **as_user,
    )
    pwfile.unlink()

    def command(port: int) -> list[str]:
        settings = {
            "listen_addresses": "127.0.0.1",
            "port": port,
            "unix_socket_directories": sockets,
            "shared_preload_libraries": "pg_stat_statements",
            "max_connections": 200,
        }
        if not durable:
            settings.update({"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"})
        args = [str(PG_BIN / "postgres"), "-D", str(data)]
        for key, value in settings.items():
            args += ["-c", f"{key}={value}"]
        return args

    def is_ready(port: int) -> bool:
        return _succeeds([PG_BIN / "pg_isready", "-q", "-h", sockets, "-p", str(port), "-d", "postgres", "-U", DB_USER])

    process, port = _launch(
        "postgres",
        command,
        log,
        is_ready,
        stop_signal=signal.SIGINT,  # fast shutdown
        popen_kwargs={"cwd": base, "env": env, **as_user},
    )

    relaunch = _relauncher(
        "postgres",
        command,
        port,
        log,
        is_ready,
        stop_signal=signal.SIGINT,
        popen_kwargs={"cwd": base, "env": env, **as_user},
    )

    service = Service(
        "postgres",
        f"postgres://{DB_USER}:{password}@127.0.0.1:{port}/{DB_NAME}",
        process,
        log,
        signal.SIGINT,
        _relaunch=relaunch,
    )
    psql_env = {**os.environ, "PGPASSWORD": password, "PGCONNECT_TIMEOUT": "10"}
    psql = [
        str(PG_BIN / "psql"),
        "-X",
        "-q",
        "-v",
        "ON_ERROR_STOP=1",
        "-h",
        "127.0.0.1",
        "-p",
        str(port),
        "-U",
        DB_USER,
    ]
    try:
        _run_logged(
            [*psql, "-d", "template1", "-c", "CREATE EXTENSION IF NOT EXISTS pg_stat_statements"], log, env=psql_env
        )
        _run_logged([*psql, "-d", "postgres", "-c", f"CREATE DATABASE {DB_NAME}"], log, env=psql_env)
    except BaseException:
        service.stop()
        raise
    return service


def start_mariadb(root: Path, *, durable: bool = False) -> Service:
    """Start MariaDB under ``root/mariadb``.

    User ``durable`` (at '%', '127.0.0.1' and 'localhost') has ALL PRIVILEGES
    on ``*.*`` WITH GRANT OPTION; database ``durable`` is utf8mb4, which is
    also the server default.

    ``durable``: False (the tests' default) runs with
    ``innodb_flush_log_at_trx_commit=2`` and the doublewrite buffer off (a
    commit writes the log but does not flush it). True keeps MariaDB's
    defaults (flush at every commit, doublewrite on).
    """
    base, as_user = _service_dir(root, "mariadb", "mysql")
    data, tmp, log = base / "data", base / "tmp", base / "server.log"
    sock = base / "mysqld.sock"
    # A private tmpdir: mariadbd deletes every "#sql*" file in its tmpdir at
    # startup, which breaks concurrent instances sharing /tmp.
    tmp.mkdir()
    if as_user:
        os.chown(tmp, as_user["user"], as_user["group"])
    env = _server_env(base)
    _run_logged(
        [
            "mariadb-install-db",
            "--no-defaults",
            f"--datadir={data}",
            "--auth-root-authentication-method=normal",
            "--skip-test-db",
            "--skip-name-resolve",
            f"--tmpdir={tmp}",
        ],
        log,
        cwd=base,
        env=env,
        **as_user,
    )

    def command(port: int) -> list[str]:
        return [
            shutil.which("mariadbd") or "/usr/sbin/mariadbd",
            "--no-defaults",
            f"--datadir={data}",
            f"--port={port}",
            "--bind-address=127.0.0.1",
            f"--socket={sock}",
            f"--pid-file={base / 'mariadbd.pid'}",
            f"--tmpdir={tmp}",
            "--skip-name-resolve",
            "--character-set-server=utf8mb4",
            "--max-connections=300",
            *([] if durable else ["--innodb-flush-log-at-trx-commit=2", "--innodb-doublewrite=0"]),
        ]

    root_client = ["mariadb", "--no-defaults", f"--socket={sock}", "--user=root"]

    def is_ready(_port: int) -> bool:
        return sock.exists() and _succeeds([*root_client, "-e", "SELECT 1"])

    popen_kwargs = {"cwd": base, "env": env, **as_user}
    process, port = _launch("mariadb", command, log, is_ready, stop_signal=signal.SIGTERM, popen_kwargs=popen_kwargs)
    password = secrets.token_hex(16)
    service = Service(
        "mariadb",
        f"mysql://{DB_USER}:{password}@127.0.0.1:{port}/{DB_NAME}",
        process,
        log,
        _relaunch=_relauncher(
            "mariadb", command, port, log, is_ready, stop_signal=signal.SIGTERM, popen_kwargs=popen_kwargs
        ),
    )
    accounts = [f"'{DB_USER}'@'{host}'" for host in ("%", "127.0.0.1", "localhost")]
    setup = (
        "".join(
            f"CREATE USER {a} IDENTIFIED BY '{password}';GRANT ALL PRIVILEGES ON *.* TO {a} WITH GRANT OPTION;"
            for a in accounts
        )
        + f"CREATE DATABASE {DB_NAME} CHARACTER SET utf8mb4;"
    )
    try:
        _run_logged([*root_client, "-e", setup], log)
        _run_logged(
            [
                "mariadb",
                "--no-defaults",
                "--protocol=TCP",
                "--host=127.0.0.1",
                f"--port={port}",
                f"--user={DB_USER}",
                f"--password={password}",
                f"--database={DB_NAME}",
                "-e",
                "SELECT 1",
            ],
            log,
        )
    except BaseException:
        service.stop()
        raise
    return service


def start_redis(root: Path) -> Service:
    """Start Redis under ``root/redis`` without persistence."""
    base = Path(root) / "redis"
    base.mkdir(mode=0o700)
    log, sock = base / "server.log", base / "redis.sock"

    def command(port: int) -> list[str]:
        return [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--unixsocket",
            str(sock),
            "--unixsocketperm",
            "700",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(base),
            "--daemonize",
            "no",
        ]

    def is_ready(_port: int) -> bool:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(2)
                conn.connect(str(sock))
                conn.sendall(b"PING\r\n")
                return conn.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    popen_kwargs = {"cwd": base, "env": _server_env(base)}
    process, port = _launch("redis", command, log, is_ready, stop_signal=signal.SIGTERM, popen_kwargs=popen_kwargs)
    relaunch = _relauncher("redis", command, port, log, is_ready, stop_signal=signal.SIGTERM, popen_kwargs=popen_kwargs)
    return Service("redis", f"redis://127.0.0.1:{port}/0", process, log, _relaunch=relaunch)


@contextlib.contextmanager
def services(
    pg: bool = True,
    mysql: bool = True,
    redis: bool = True,
    base_dir: str | os.PathLike[str] | None = None,
    *,
    durable: bool = False,
) -> Iterator[dict[str, str]]:
    """Run the selected servers; yield their ``DS_*_URL`` variables.

    Everything lives in a new temporary directory (inside ``base_dir`` if
    given), which is removed together with the servers on exit. ``durable``:
    the database servers flush at every commit (see :func:`start_postgres`).
    """
    root = Path(tempfile.mkdtemp(prefix="ds-services-", dir=base_dir))
    root.chmod(0o755)  # let the postgres/mysql users reach their subdirectories
    started: list[tuple[str, Service]] = []
    try:
        for wanted, var, start in (
            (pg, "DS_PG_URL", functools.partial(start_postgres, durable=durable)),
            (mysql, "DS_MYSQL_URL", functools.partial(start_mariadb, durable=durable)),
            (redis, "DS_REDIS_URL", start_redis),
        ):
            if wanted:
                started.append((var, start(root)))
        yield {var: service.url for var, service in started}
    finally:
        for _, service in reversed(started):
            service.stop()
        shutil.rmtree(root, ignore_errors=True)


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------


def install() -> int:
    """apt-get install whichever of APT_PACKAGES is missing."""

    def installed(package: str) -> bool:
        result = subprocess.run(
            ["dpkg-query", "-W", "-f=${db:Status-Status}", package],
            capture_output=True,
            text=True,
            check=False,
        )
        return result.returncode == 0 and result.stdout == "installed"

    missing = [p for p in APT_PACKAGES if not installed(p)]
    if not missing:
        print("services: all packages already installed")
        return 0
    print(f"services: installing {' '.join(missing)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update"], env=env, check=True)
    subprocess.run(["apt-get", "install", "-y", *missing], env=env, check=True)
    return 0


def _run_command(cmd: list[str], env: dict[str, str]) -> int:
    """Run CMD to completion and return a shell-style exit status.

    While it runs, SIGTERM and SIGHUP are forwarded to it and SIGINT is
    ignored here (a terminal's Ctrl-C reaches CMD directly), so the caller
    gets to stop the services after CMD has finished.  CMD gets SIGTERM if
    this process is killed outright.
    """
    try:
        process = subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent(signal.SIGTERM))
    except OSError as exc:
        print(f"services: cannot run {cmd[0]}: {exc}", file=sys.stderr)
        return 127
    forwarded = (signal.SIGTERM, signal.SIGHUP)
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for sig in forwarded:
            signal.signal(sig, lambda signum, _frame: process.send_signal(signum))
        returncode = process.wait()
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait()
    return 128 - returncode if returncode < 0 else returncode


def _raise_system_exit(signum: int, _frame: object) -> None:
    """Signal handler turning SIGTERM/SIGHUP into a clean exit."""
    raise SystemExit(128 + signum)


def run(cmd: list[str], pg: bool, mysql: bool, redis: bool, base_dir: str | None, durable: bool = False) -> int:
    """Start services, run CMD with their URLs, stop services; CMD's status."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_system_exit)
    started = time.monotonic()
    try:
        with services(pg=pg, mysql=mysql, redis=redis, base_dir=base_dir, durable=durable) as urls:
            print(f"services: {', '.join(urls)} ready in {time.monotonic() - started:.1f}s", file=sys.stderr)
            try:
                return _run_command(cmd, {**os.environ, **urls})
            finally:
                # Let the shutdown finish whatever arrives now.
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                    signal.signal(sig, signal.SIG_IGN)
    except ServiceError as exc:
        print(f"services: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("services: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT


def main(argv: list[str] | None = None) -> int:
    """Entry point; see the module docstring for usage."""
    argv = sys.argv[1:] if argv is None else argv
    cmd: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, cmd = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(
        prog="services.py",
        description="Throwaway PostgreSQL, MariaDB and Redis servers.",
    )
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("install", help="apt-get install the missing server packages")
    run_parser = sub.add_parser(
        "run",
        usage="%(prog)s [--pg] [--mysql] [--redis] [--durable] [--dir DIR] -- CMD [ARGS...]",
        help="start services, run CMD with DS_*_URL set, stop services",
    )
    run_parser.add_argument("--pg", action="store_true", help="start PostgreSQL")
    run_parser.add_argument("--mysql", action="store_true", help="start MariaDB")
    run_parser.add_argument("--redis", action="store_true", help="start Redis")
    run_parser.add_argument(
        "--durable",
        action="store_true",
        help="database servers flush at every commit (PostgreSQL fsync, synchronous_commit, full_page_writes on)",
    )
    run_parser.add_argument("--dir", help="parent of the temporary directory")
    args = parser.parse_args(argv)
    if args.action == "install":
        return install()
    if not cmd:
        run_parser.error("missing -- CMD [ARGS...]")
    if args.dir and not os.path.isdir(args.dir):
        run_parser.error(f"--dir {args.dir}: not a directory")
    everything = not (args.pg or args.mysql or args.redis)
    return run(cmd, args.pg or everything, args.mysql or everything, args.redis or everything, args.dir, args.durable)


if __name__ == "__main__":
    sys.exit(main())
