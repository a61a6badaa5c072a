"""A throwaway PostgreSQL server for the tests and `carpool bench soak --db postgres`: Debian's postgresql (`make
test` installs it), a data dir and unix socket in a temp dir, a free TCP port on 127.0.0.1, trust authentication.
Started once per test session (~2 s here); the soak restarts its own mid-run.

PostgreSQL refuses to run as root, and this project's machines run everything as root: then initdb and the
server run as the `postgres` user the Debian package creates, in a temp dir that user owns.
"""

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from carpool.bench.local_server import free_port


def postgres_bin_dir() -> Path | None:
    """The newest installed PostgreSQL's binaries, or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(Path(p).parts[-3]))
    if found:
        return Path(found[-1]).parent
    on_path = shutil.which("pg_ctl")
    return Path(on_path).parent if on_path else None


class PostgresServer:
    def __init__(self, bin_dir: Path):
        self.bin_dir = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix="carpool-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self._user = None
        if os.geteuid() == 0:
            self._user = "postgres"
            entry = pwd.getpwnam(self._user)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        self.superuser = self._user or pwd.getpwuid(os.geteuid()).pw_name
        self._test_database: str | None = None

    def _run(self, *args: str) -> None:
        command = [str(self.bin_dir / args[0]), *args[1:]]
        if self._user:
            command = ["runuser", "-u", self._user, "--", *command]
        subprocess.run(command, check=True, capture_output=True, timeout=60)

    def start(self) -> "PostgresServer":
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", self.superuser, "--no-sync", "-E", "UTF8")
        self._start_server()
        return self

    def _start_server(self) -> None:
        # fsync off: a test server's data need not survive a power cut, and it makes commits ~10x faster here.
        options = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off -c max_connections=200"
        self._run(
            "pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.root / "log"), "-w", "-t", "30", "start"
        )

    def restart(self, down_seconds: float = 0.0) -> None:
        """Down at once, as a crash would take it (`-m immediate`: no checkpoint, WAL replay on start), `down_seconds`
        of outage, then up on the same port; every session open on it is gone."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        time.sleep(down_seconds)
        self._start_server()

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{self.superuser}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """A fresh, empty database; its URL."""
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def create_schema(self, name: str) -> str:
        """A fresh, empty schema in the server's one test database, and a URL whose sessions work in it: as good as
        a database of its own for carpool's tables, in 10 ms instead of CREATE DATABASE's ~1 s."""
        import psycopg

        if self._test_database is None:
            self._test_database = self.create_database("carpool_tests")
        with psycopg.connect(self._test_database, autocommit=True) as conn:
            conn.execute(f'CREATE SCHEMA "{name}"')
        return f"{self._test_database}?options=-c%20search_path%3D{name}"

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
