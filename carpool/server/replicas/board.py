"""Where the replicas of an autoscaled model report themselves: a small named Ray actor per model.

A handle to an autoscaled deployment cannot address one of its replicas (Ray's router picks), yet the ingress sums
every replica's EngineSnapshot and serves each one's engine series in /metrics. So each replica posts its status and
metrics text here twice a second and the ingress reads them all; a replica that stops posting (drained and removed,
or dead) drops out after STALE_SECONDS.
"""

import threading
import time

import ray

POST_SECONDS = 0.5
STALE_SECONDS = 3.0  # six missed posts: the replica is gone (a busy replica posts from its own thread regardless)
NAMESPACE = "carpool"


@ray.remote(num_cpus=0)
class ReplicaBoard:
    def __init__(self):
        self._posts: dict[str, tuple[float, dict]] = {}

    def post(self, replica: str, report: dict) -> None:
        self._posts[replica] = (time.monotonic(), report)

    def read(self) -> dict[str, dict]:
        """{replica: its last report} of the replicas that posted in the last STALE_SECONDS."""
        now = time.monotonic()
        for replica in [r for r, (at, _) in self._posts.items() if now - at > STALE_SECONDS]:
            del self._posts[replica]
        return {replica: report for replica, (_, report) in self._posts.items()}


def board_name(model_name: str) -> str:
    return f"carpool-replicas-{model_name.replace('/', '_')}"


def open_board(model_name: str):
    """The model's board, made by whichever of the ingress and the first replica asks first. Detached: a replica
    may outlive the ingress that started it (a `serve run` redeploy keeps the old board and its entries lapse)."""
    return ReplicaBoard.options(
        name=board_name(model_name), namespace=NAMESPACE, get_if_exists=True, lifetime="detached"
    ).remote()


class BoardPoster:
    """A replica's reports, from a thread of its own: Ray Serve's event loop may be busy, and a post that stopped
    while the replica still serves would drop it from the ingress's view."""

    def __init__(self, board, replica: str, report):
        self.board, self.replica, self.report = board, replica, report
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="carpool-board", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(POST_SECONDS):
            try:
                report = self.report()
            except Exception:  # read off the engine thread: a rare torn read; the next post is 0.5 s away
                continue
            self.board.post.remote(self.replica, report)

    def stop(self) -> None:
        self._stopped.set()
