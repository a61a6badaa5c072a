"""The block matrices the loader builds, written once per host and mapped read-only by every process after.

A GGUF file's blocks are used in place (views into the mapped file, shared through the page cache), but the
matrices the loader builds from them were anonymous copies in every process: the fused q/k/v and gate/up projections
(a layer's blocks stacked) and, where the kernel path runs them faster, rows rearranged (GGMLWeight.for_kernels). The
first load builds them one at a time into a layout file beside the model's index (each written, then dropped) and
every load maps that file read-only, so replicas on one host share its pages and a load never holds two copies.
PROT_READ: a write into the weights faults instead of silently copying the page.

The file: the matrices back to back (each at a page boundary), then a JSON manifest (the header below, and each
matrix's name, offset, shape, block type and layout), its length (8 bytes, little-endian) and MAGIC. It is written
under a temporary name, flushed to disk and renamed, so a crash or two processes racing never leave a torn file under
the final name; one cut short or written for another version, kernel path or file is rebuilt.

Its key is the model's cache directory (the GGUF's path, size and mtime: resolve_model_dir) plus the quantization,
the kernel path and LAYOUT_VERSION, and the manifest repeats the GGUF's size and mtime: a SHA-256 of the GGUF instead
would cost every start 1.06 s for the 1.5B's 1.1 GB from the page cache (Xeon, one core; ~4.5 s for a 7B's 4.7 GB),
half the warm load, to catch a file rewritten in place with its size and mtime kept, which the index trusts too.
"""

import ctypes
import json
import logging
import mmap
import os
import time
import warnings
from pathlib import Path

import gguf
import numpy as np
import torch

from carpool.kernels import kernel_path
from carpool.models.loader import resolve_model_dir
from carpool.models.quantization import BUILT_IN_MEMORY, LAYOUT_VERSION, GGMLWeight

log = logging.getLogger(__name__)

MAGIC = b"CPLAYOUT"
TRAILER_BYTES = 8 + len(MAGIC)  # the manifest's length, then MAGIC


def layout_file(directory: Path, quantization: str) -> Path:
    return Path(directory) / f"layouts-{quantization}-{kernel_path()}-v{LAYOUT_VERSION}.bin"


def _forget_older_versions(path: Path) -> None:
    """Delete the files `path` (a layout file just written) succeeds: the same model, quantization and kernel path
    at another LAYOUT_VERSION, so a version bump does not leave a stale copy of every model's weights on disk."""
    for stale in path.parent.glob(path.name.rsplit("-v", 1)[0] + "-v*.bin"):
        if stale != path:
            stale.unlink(missing_ok=True)


def layout_header(gguf_path: str, quantization: str) -> dict:
    """What a layout file must have been written for to be read."""
    stat = os.stat(gguf_path)
    source = {"path": gguf_path, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    return {"version": LAYOUT_VERSION, "kernel_path": kernel_path(), "quantization": quantization, "gguf": source}


class LayoutFile:
    """A layout file, mapped read-only: `matrix(name, build)` (as quantization.BuiltInMemory) returns the
    matrix from the file, building it in memory only if the file lacks it."""

    def __init__(self, data: np.ndarray, matrices: dict):
        self.data, self.matrices = data, matrices

    @classmethod
    def open(cls, path: Path, header: dict) -> "LayoutFile | None":
        """The file at `path` if it is whole and was written for `header`; None if it is missing or unusable."""
        try:
            with open(path, "rb") as file:
                size = os.fstat(file.fileno()).st_size
                mapping = mmap.mmap(file.fileno(), 0, prot=mmap.PROT_READ) if size else None
        except FileNotFoundError:
            return None
        problem = _problem(mapping, header)
        if isinstance(problem, str):
            log.warning("weight layout file %s %s: rebuilding it", path, problem)
            return None
        with warnings.catch_warnings():  # read-only by design: torch warns that it cannot write to it
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(np.frombuffer(mapping, dtype=np.uint8))
        return cls(data, problem)

    def matrix(self, name: str, build):
        entry = self.matrices.get(name)
        if entry is None:
            return build()
        shape, start = entry["shape"], entry["offset"]
        data = self.data[start : start + shape[0] * shape[1]].view(shape)
        return GGMLWeight(gguf.GGMLQuantizationType[entry["type"]], data, entry["layout"])


def _problem(mapping: mmap.mmap | None, header: dict) -> str | dict:
    """What is wrong with a layout file's bytes (a sentence), or its matrices when nothing is."""
    size = 0 if mapping is None else len(mapping)
    if size < TRAILER_BYTES or mapping[-len(MAGIC) :] != MAGIC:
        return "is cut short (no trailer)"
    length = int.from_bytes(mapping[-TRAILER_BYTES : -len(MAGIC)], "little")
    end = size - TRAILER_BYTES - length
    if end < 0:
        return "is cut short (its manifest runs past its start)"
    try:
        manifest = json.loads(mapping[end : size - TRAILER_BYTES])
    except ValueError:
        return "has an unreadable manifest"
    if manifest.get("header") != header:
        return f"was written for {manifest.get('header')}, not {header}"
    matrices = manifest["matrices"]
    if any(m["offset"] + m["shape"][0] * m["shape"][1] > end for m in matrices.values()):
        return "is cut short (a matrix runs into its manifest)"
    return matrices


def _forget_abandoned(path: Path) -> None:
    """Delete the partial files of `path` whose writer is gone (killed mid-write): up to a model's size each."""
    for partial in path.parent.glob(f"{path.name}.*.partial"):
        pid = partial.name.removeprefix(f"{path.name}.").removesuffix(".partial")
        if pid.isdigit() and not _running(int(pid)):
            partial.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


class LayoutWriter:
    """Builds each matrix, appends it to a new layout file and drops it: `matrix` returns a placeholder on the
    meta device, so the model it is loaded into (a scratch one) holds none of them."""

    def __init__(self, path: Path, header: dict):
        self.path, self.header = path, header
        _forget_abandoned(path)
        self.partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        self.file = open(self.partial, "wb")
        self.matrices: dict[str, dict] = {}
        self.placeholders: dict[str, GGMLWeight | None] = {}

    def matrix(self, name: str, build):
        if name not in self.placeholders:
            self.placeholders[name] = self._write(name, build())
        return self.placeholders[name]

    def _write(self, name: str, built: GGMLWeight | None) -> GGMLWeight | None:
        if built is None:
            return None
        offset = -(-self.file.tell() // mmap.PAGESIZE) * mmap.PAGESIZE
        self.file.seek(offset)
        self.file.write(built.data.contiguous().numpy().data)
        shape = list(built.data.shape)
        self.matrices[name] = {"offset": offset, "shape": shape, "type": built.qtype.name, "layout": built.layout}
        return GGMLWeight(built.qtype, torch.empty(shape, dtype=torch.uint8, device="meta"), built.layout)

    def finish(self) -> None:
        manifest = json.dumps({"header": self.header, "matrices": self.matrices}).encode()
        self.file.write(manifest + len(manifest).to_bytes(8, "little") + MAGIC)
        self.file.flush()
        self.size = self.file.tell()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.partial, self.path)
        _forget_older_versions(self.path)

    def abort(self) -> None:
        self.file.close()
        self.partial.unlink(missing_ok=True)


def load_with_layouts(directory: Path, gguf_path: str | None, quantization: str, state: dict, build_model):
    """`build_model(layouts)` (a model loaded with its block matrices from `layouts`, as CausalLM.load_hf_weights
    takes them), with those matrices mapped from the model's layout file, written first if it is missing or
    unusable. A model with no block matrices or not from a GGUF file, or a cache that cannot be written (read-only,
    full), builds them in memory as before."""
    if gguf_path is None or not any(isinstance(v, GGMLWeight) for v in state.values()):
        return build_model(BUILT_IN_MEMORY)
    path, header = layout_file(directory, quantization), layout_header(gguf_path, quantization)
    layouts = LayoutFile.open(path, header)
    if layouts is None:
        try:
            writer = LayoutWriter(path, header)
        except OSError as error:
            log.warning("cannot write the weight layout file %s (%s): building the weights in memory", path, error)
            return build_model(BUILT_IN_MEMORY)
        start = time.monotonic()
        try:
            build_model(writer)  # on the meta device: each matrix built, written and dropped in turn
            writer.finish()
            _trim_heap()
        except OSError as error:
            writer.abort()
            log.warning("cannot write the weight layout file %s (%s): building the weights in memory", path, error)
            return build_model(BUILT_IN_MEMORY)
        except BaseException:
            writer.abort()
            raise
        log.info(
            "wrote the weight layout file %s (%.2f GB) in %.1f s", path, writer.size / 1e9, time.monotonic() - start
        )
        # Ours, or the same bytes a process racing us renamed over it; gone only if deleted since.
        layouts = LayoutFile.open(path, header) or BUILT_IN_MEMORY
    return build_model(layouts)


def _trim_heap() -> None:
    """Hand the heap's free pages back to the OS. The matrices the writer built and dropped (a layer's fused
    gate/up: 15 MB on the 1.5B) fall under glibc's mmap threshold once it has risen past them, so their pages stayed
    in this process's heap after the load: 0.29 GiB of anonymous memory on the 1.5B."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def forget_layouts(model: str | None) -> list[Path]:
    """Delete a model's layout files (every quantization and kernel path); returns the paths deleted."""
    paths = sorted(resolve_model_dir(model).glob("layouts-*.bin"))
    for path in paths:
        path.unlink()
    return paths
