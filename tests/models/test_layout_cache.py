"""The block matrices the loader builds (fused projections, rearranged rows) are written once to a layout file and
mapped read-only by every load after it (carpool.models.layout_cache), on the default model (SmolLM2-135M)."""

import os
import subprocess

import pytest

import carpool.models
from carpool import LLM, SamplingParams
from carpool.kernels import kernel_path
from carpool.models import layers, layout_cache, load_model, quantization
from carpool.models.loader import default_model_path
from carpool.models.quantization import BUILT_IN_MEMORY, LAYOUT_VERSION, GGMLEmbedding, GGMLLinear, GGMLWeight


@pytest.fixture
def layouts(tmp_path, monkeypatch):
    """The default model's layout file, in a folder of the test's own."""
    path = tmp_path / "layouts.bin"
    monkeypatch.setattr(layout_cache, "layout_file", lambda directory, quantization: path)
    return path


@pytest.fixture
def builds(monkeypatch):
    """How many matrices the loader stacks (fused projections) and rearranges."""
    counts = {"stacked": 0, "arranged": 0}
    concat_rows, arranged = layers.concat_rows, GGMLWeight.arranged

    def counted(kind, function):
        def wrapper(*args, **kwargs):
            counts[kind] += 1
            return function(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(layers, "concat_rows", counted("stacked", concat_rows))
    monkeypatch.setattr(GGMLWeight, "arranged", counted("arranged", arranged))
    return counts


@pytest.fixture(params=(True, False), ids=("rows rearranged", "gguf rows"))
def rearranged(request, monkeypatch):
    """Q4_1 rows octet-major as on avx2/avx512 (the default model's blocks are Q4_1), or in GGUF's layout."""
    monkeypatch.setattr(quantization, "OCTET_MAJOR_PATHS", {kernel_path()} if request.param else set())
    return request.param


def _mappings(path: str) -> list[tuple[int, int, str]]:
    """(start, end, permissions) of each range of this process that maps `path`."""
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5] == path:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                found.append((start, end, fields[1]))
    return found


def _block_buffers(model) -> dict[str, tuple]:
    """Each block-format module's weight, and whether the loader built it (stacked or rearranged: the layout flags
    in its qtype) rather than taking it from the GGUF file as it is."""
    return {
        name: (module.qweight, ".parts." in name or module.qtype > 0xFF)
        for name, module in model.named_modules()
        if isinstance(module, GGMLLinear | GGMLEmbedding)
    }


def test_the_layout_file_is_written_once_then_mapped(layouts, builds, rearranged):
    load_model(None, quantization="auto")
    written = dict(builds)
    assert written["stacked"] > 0 and (written["arranged"] > 0) == rearranged
    stat = layouts.stat()

    load_model(None, quantization="auto")
    assert builds == written, "the second load built matrices again"
    assert (layouts.stat().st_ino, layouts.stat().st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)
    assert not list(layouts.parent.glob("*.partial"))


def test_built_matrices_are_mapped_read_only_from_the_layout_file(layouts, rearranged):
    """Every block matrix is file-backed: the fused and rearranged ones in the layout file, mapped without write
    permission (shared by every process on the host), the others in the GGUF file; none is anonymous memory."""
    model, _, _ = load_model(None, quantization="auto")
    in_layouts, in_gguf = _mappings(str(layouts)), _mappings(default_model_path())
    assert in_layouts and all(perms.startswith("r-") for _, _, perms in in_layouts)
    built = {name: False for name, (_, was_built) in _block_buffers(model).items() if was_built}
    for name, (qweight, was_built) in _block_buffers(model).items():
        address = qweight.data_ptr()
        mapped = any(start <= address < end for start, end, _ in in_layouts)
        assert mapped or any(start <= address < end for start, end, _ in in_gguf), f"{name} is anonymous"
        if was_built:
            built[name] = mapped
    assert len(built) >= 2 * model.config.num_layers
    assert all(built.values()), f"built but not mapped from the layout file: {[n for n, m in built.items() if not m]}"
    assert any(".parts." not in name for name in built) == rearranged


@pytest.mark.parametrize("damage", ("cut short", "emptied", "of the previous version"))
def test_a_damaged_or_stale_layout_file_is_rebuilt(layouts, builds, caplog, monkeypatch, damage):
    with monkeypatch.context() as patch:
        if damage == "of the previous version":
            patch.setattr(layout_cache, "LAYOUT_VERSION", LAYOUT_VERSION - 1)
        load_model(None, quantization="auto")
    whole = layouts.stat().st_size
    if damage != "of the previous version":
        os.truncate(layouts, whole // 2 if damage == "cut short" else 0)
    written = builds["stacked"]

    load_model(None, quantization="auto")
    assert builds["stacked"] == 2 * written, "the damaged file was read, not rebuilt"
    assert f"weight layout file {layouts}" in caplog.text and "rebuilding it" in caplog.text
    if damage == "of the previous version":
        assert "'version': 0" in caplog.text
    assert layouts.stat().st_size == whole

    load_model(None, quantization="auto")
    assert builds["stacked"] == 2 * written, "the rebuilt file was not reused"


def test_a_killed_writers_partial_file_is_deleted_by_the_next_writer(layouts):
    finished = subprocess.Popen(["true"])
    finished.wait()  # its id now names no process
    abandoned = layouts.with_name(f"{layouts.name}.{finished.pid}.partial")
    abandoned.write_bytes(b"half a model")
    live = layouts.with_name(f"{layouts.name}.{os.getppid()}.partial")  # a writer still running: left alone
    live.write_bytes(b"being written")
    load_model(None, quantization="auto")
    assert not abandoned.exists() and live.exists() and layouts.exists()


def test_an_unwritable_layout_file_leaves_the_weights_in_memory(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(layout_cache, "layout_file", lambda directory, quantization: tmp_path / "none" / "layouts")
    model, _, _ = load_model(None, quantization="auto")
    assert "building the weights in memory" in caplog.text
    assert model.layers[0].mlp.gate_up_proj.parts[0].qweight.is_contiguous()


def test_mapped_weights_compute_what_weights_built_in_memory_do(layouts, rearranged, monkeypatch):
    """Bit-identical: the same tokens and the same logprobs (every prompt position's top 5 too) whether the built
    matrices were just written and mapped, mapped from the file a previous load wrote, or built in this process."""
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=5, prompt_logprobs=5, ignore_eos=True)

    def run():
        llm = LLM(dtype="float32", matmul="exact", num_kv_blocks=64)
        output = llm.generate("The layout file holds", params)[0]
        return output.token_ids, output.logprobs, output.prompt_logprobs

    written, mapped = run(), run()
    with monkeypatch.context() as patch:
        patch.setattr(carpool.models, "load_with_layouts", lambda d, g, q, s, build_model: build_model(BUILT_IN_MEMORY))
        in_memory = run()
    assert written == mapped == in_memory


def test_a_new_layout_version_deletes_the_files_it_succeeds(tmp_path, monkeypatch):
    real = layout_cache.layout_file
    monkeypatch.setattr(layout_cache, "layout_file", lambda directory, quantization: real(tmp_path, quantization))
    with monkeypatch.context() as patch:
        patch.setattr(layout_cache, "LAYOUT_VERSION", LAYOUT_VERSION - 1)
        load_model(None, quantization="auto")
    [previous] = tmp_path.glob("layouts-*")
    another_quantization = tmp_path / previous.name.replace("layouts-auto-", "layouts-q8_0-")
    another_quantization.write_bytes(b"kept: not the same weights")

    load_model(None, quantization="auto")
    current = real(tmp_path, "auto")
    assert previous != current
    assert sorted(tmp_path.glob("layouts-*")) == sorted([current, another_quantization])


def test_weights_made_dense_write_no_layout_file(layouts):
    """Nothing is built in blocks where every weight is dequantized (`none`, and the same on CUDA devices)."""
    load_model(None, quantization="none")
    assert not layouts.exists()
