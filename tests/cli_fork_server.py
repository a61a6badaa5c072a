"""A `carpool` command that starts in milliseconds, for tests that run many shell lines calling it.

`python -m carpool.cli` spends seconds importing torch before it parses its arguments (4-5 s each on a loaded
2-core machine; the docs' shell examples call it about thirty times). CliForkServer imports the command once in a
process of its own and, for each call, forks a child that runs `carpool.cli.main(argv)` with the caller's
arguments, environment, working directory and standard streams (passed over a Unix socket), so each call is a
real process with the exit status and output the real command would give. The server itself never runs torch
code: a child forked after OpenMP's threads started could hang in its first parallel region.

A call that sets a variable carpool reads at import (IMPORT_TIME_VARIABLES: `CARPOOL_KERNEL_ISA=avx2 carpool info`)
otherwise than the server's environment runs `python -m carpool.cli` itself, so it sees what it asked for.
`install(folder)` writes the `carpool` client script there; put the folder on PATH.
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Read when carpool is imported (the kernels' path, torch's own instruction set): a call that sets one of these
# otherwise than the server's environment runs as a process of its own instead.
IMPORT_TIME_VARIABLES = ("CARPOOL_KERNEL_ISA", "ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS")

SERVER = r"""
import json, os, signal, socket, sys
import carpool.cli
carpool.cli.build_parser()  # imports every area's subcommands, torch and the kernels; runs none of their code

signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(sys.argv[1])
listener.listen(16)
print("ready", flush=True)
while True:
    conn, _ = listener.accept()
    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    if os.fork() == 0:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the command's own subprocesses are its to wait for
        listener.close()
        call = json.loads(message)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(call["cwd"])
        os.environ.clear()
        os.environ.update(call["env"])
        sys.argv = ["carpool", *call["argv"]]
        try:
            status = carpool.cli.main(call["argv"])
        except SystemExit as done:
            status = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        except BaseException:
            import traceback
            traceback.print_exc()
            status = 1
        sys.stdout.flush()
        sys.stderr.flush()
        conn.sendall(bytes([status & 0xFF]))
        os._exit(0)
    for fd in fds:
        os.close(fd)
    conn.close()
"""

CLIENT = r"""#!{python} -S
import json, os, socket, sys
if any(os.environ.get(name) != value for name, value in {imported!r}.items()):
    os.execv({python!r}, [{python!r}, "-m", "carpool.cli", *sys.argv[1:]])
conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
conn.connect({address!r})
call = {{"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}}
socket.send_fds(conn, [json.dumps(call).encode()], [0, 1, 2])
conn.shutdown(socket.SHUT_WR)
status = conn.recv(1)
sys.exit(status[0] if status else 1)
"""


class CliForkServer:
    def __init__(self):
        self.folder = Path(tempfile.mkdtemp(prefix="carpool-cli-"))
        self.address = str(self.folder / "cli.sock")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
        self.process = subprocess.Popen(
            [sys.executable, "-c", SERVER, self.address], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
        )
        if self.process.stdout.readline().strip() != "ready":
            raise AssertionError(f"the carpool fork server did not start (exit {self.process.wait()})")

    def install(self, folder: Path) -> None:
        command = folder / "carpool"
        imported = {name: os.environ.get(name) for name in IMPORT_TIME_VARIABLES}
        command.write_text(CLIENT.format(python=sys.executable, address=self.address, imported=imported))
        command.chmod(0o755)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait()
