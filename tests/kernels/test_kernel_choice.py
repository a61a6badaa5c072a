"""Which kernel build a CPU gets: the chooser, CARPOOL_KERNEL_ISA, the CPU feature reading and the AMX probe."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from carpool.kernels import _cpu_features, amx_probe, built_paths, cpu_features, cpu_model, kernel_path, refused_paths
from carpool.kernels.isa import PATHS, REQUIRED_FEATURES, X86_64_V3, choose_path, missing_features

ZEN3 = set(X86_64_V3)  # AVX2, FMA, F16C, BMI...: no AVX-512
ALDER_LAKE = ZEN3 | {"avx_vnni"}  # Intel client chips: AVX-VNNI's 256-bit vpdpbusd, no AVX-512
ICE_LAKE = ZEN3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni"}  # no AVX512-BF16
ZEN4 = set(REQUIRED_FEATURES["avx512"])
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8"}
ALL_BUILT = set(PATHS)
X86 = platform.machine().lower() in ("x86_64", "amd64")


def test_each_cpu_gets_the_best_path_it_has_every_feature_of():
    assert choose_path(ZEN4, ALL_BUILT).path == "avx512"
    assert choose_path(SAPPHIRE_RAPIDS, ALL_BUILT).path == "amx"
    assert choose_path(ZEN4 | {"amx_tile", "amx_int8"}, ALL_BUILT).path == "avx512"  # the amx build runs AMX-BF16
    assert choose_path(ICE_LAKE, ALL_BUILT).path == "avx2"  # the avx512 build uses bf16 instructions
    assert choose_path(ZEN3, ALL_BUILT).path == "avx2"
    assert choose_path(ALDER_LAKE, ALL_BUILT).path == "avxvnni"
    assert choose_path(ZEN4 | {"avx_vnni"}, ALL_BUILT).path == "avx512"  # Zen 5: AVX-512 first
    assert choose_path(ALDER_LAKE, {"avx2", "portable"}).path == "avx2"  # a build without it
    assert choose_path(ZEN3 - {"f16c"}, ALL_BUILT).path == "portable"
    assert choose_path(set(), {"portable"}).path == "portable"  # aarch64: only the portable build exists
    assert choose_path(ZEN4, {"avx2", "portable"}).path == "avx2"
    assert not choose_path(ZEN4, ALL_BUILT).forced


def test_a_forced_path_is_used_or_refused_naming_what_is_missing():
    choice = choose_path(ZEN4, ALL_BUILT, forced="portable")
    assert (choice.path, choice.forced) == ("portable", True)
    with pytest.raises(
        ValueError,
        match=r"CARPOOL_KERNEL_ISA: this CPU cannot run the avx512 kernels, it lacks "
        r"avx512f, avx512bw, avx512cd, avx512dq, avx512vl, avx512_bf16, avx512_vnni",
    ):
        choose_path(ZEN3, ALL_BUILT, forced="avx512")
    with pytest.raises(ValueError, match="lacks avx512_bf16$"):
        choose_path(ICE_LAKE, ALL_BUILT, forced="avx512")
    with pytest.raises(ValueError, match="cannot run the avxvnni kernels, it lacks avx_vnni$"):
        choose_path(ZEN4, ALL_BUILT, forced="avxvnni")
    with pytest.raises(ValueError, match="not built in this install"):
        choose_path(set(), {"portable"}, forced="avx2")
    with pytest.raises(ValueError, match="unknown kernel path 'sse9'"):
        choose_path(ZEN4, ALL_BUILT, forced="sse9")


def test_a_path_whose_probe_failed_is_passed_over_and_refused_when_forced():
    """The VM that lists AMX, enables tile state and grants the permission, then faults on ldtilecfg."""
    refused = {"amx": "the AMX probe failed: tile multiply killed by signal 11"}
    assert choose_path(SAPPHIRE_RAPIDS, ALL_BUILT, refused=refused).path == "avx512"
    with pytest.raises(ValueError, match="cannot run the amx kernels: the AMX probe failed: tile multiply killed"):
        choose_path(SAPPHIRE_RAPIDS, ALL_BUILT, forced="amx", refused=refused)


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    """A fresh interpreter: each process loads one kernel build, chosen at import."""
    return subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )


def test_the_environment_variable_picks_the_build_a_process_loads():
    runnable = [p for p in PATHS if p in built_paths() and not missing_features(p, cpu_features())]
    forced = runnable[-1]  # portable wherever it was built: every CPU runs it
    code = (
        "import logging; logging.basicConfig(level=logging.INFO)\nimport carpool.kernels as k; print(k.kernel_path())"
    )
    result = run_python(code, CARPOOL_KERNEL_ISA=forced)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == forced
    assert f"carpool kernels: {forced} path (forced by CARPOOL_KERNEL_ISA)" in result.stderr
    refused = run_python("import carpool.kernels", CARPOOL_KERNEL_ISA="sse9")
    assert refused.returncode != 0 and "CARPOOL_KERNEL_ISA: unknown kernel path 'sse9'" in refused.stderr
    unsupported = [p for p in PATHS if missing_features(p, cpu_features())]
    if unsupported:  # on this CPU: the error names the missing features rather than dying of SIGILL later
        refused = run_python("import carpool.kernels", CARPOOL_KERNEL_ISA=unsupported[0])
        assert refused.returncode != 0 and "this CPU cannot run" in refused.stderr


def test_the_carpool_command_says_in_one_line_why_a_forced_path_cannot_load():
    unsupported = [p for p in PATHS if missing_features(p, cpu_features())]
    cases = {"sse9": "CARPOOL_KERNEL_ISA: unknown kernel path 'sse9'"}
    if unsupported:  # on this CPU: the line names the features it lacks
        cases[unsupported[0]] = f"CARPOOL_KERNEL_ISA: this CPU cannot run the {unsupported[0]} kernels, it lacks"
    for forced, expected in cases.items():
        result = subprocess.run(
            [sys.executable, "-m", "carpool.cli", "info"],
            env={**os.environ, "CARPOOL_KERNEL_ISA": forced},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 2 and result.stdout == ""
        assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"carpool: {expected}"), result.stderr


def test_this_process_runs_the_best_path_this_cpu_has():
    if os.environ.get("CARPOOL_KERNEL_ISA"):
        pytest.skip("a forced path")
    assert kernel_path() == choose_path(cpu_features(), built_paths(), refused=refused_paths()).path
    if X86:
        assert set(PATHS) <= built_paths()
    if amx_probe().usable:  # AMX that works is used
        assert kernel_path() == "amx"


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists() or not X86, reason="needs Linux on x86-64")
def test_cpu_features_agree_with_the_kernel():
    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    aliases = {"pni": "sse3", "abm": "lzcnt"}  # /proc/cpuinfo's names for SSE3 and LZCNT
    listed = {aliases.get(flag, flag) for flag in flags.split(":", 1)[1].split()}
    names = {name for names in REQUIRED_FEATURES.values() for name in names} | {"amx_tile", "amx_bf16", "amx_int8"}
    assert {name for name in names if name in listed} == {name for name in names if name in cpu_features()}


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists() or not X86, reason="needs Linux on x86-64")
def test_the_cpu_is_named_with_the_family_and_model_the_os_reports():
    """A VM's brand string can be just "AMD EPYC" for Zen 3, 4 and 5 alike: figures name the family and model."""
    info = {
        key.strip(): value.strip()
        for key, _, value in (line.partition(":") for line in Path("/proc/cpuinfo").read_text().splitlines())
        if key.strip() in ("cpu family", "model", "stepping")
    }
    expected = f"(family {info['cpu family']}, model {info['model']}, stepping {info['stepping']})"
    assert cpu_model().endswith(expected)


@pytest.mark.skipif("amx_tile" in cpu_features(), reason="this CPU lists AMX")
def test_without_amx_the_probe_says_why_and_a_tile_instruction_kills_only_its_child():
    probe = amx_probe()
    assert not probe.usable and "amx_tile" in probe.detail
    if X86:  # what the probe does where CPUID says yes: the faulting instruction runs in a forked child
        failure = _cpu_features.tile_multiply_in_child()
        assert failure is not None and "killed by signal" in failure


@pytest.mark.skipif("amx_tile" not in cpu_features(), reason="this CPU does not list AMX")
def test_where_amx_is_listed_the_probe_ran_a_tile_multiply():
    probe = amx_probe()
    assert probe.usable == (_cpu_features.tile_multiply_in_child() is None), probe.detail
    assert ("amx" in refused_paths()) == (not probe.usable and "amx" in built_paths())


def test_carpool_info_names_the_cpu_features_probe_and_path(capsys):
    from carpool.cli import main

    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"kernel path: {kernel_path()}" in out and f"path {kernel_path()}: runs here  <- chosen" in out
    assert f"AMX probe: {'works' if amx_probe().usable else 'unavailable'}: {amx_probe().detail}" in out
    for name in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"):
        assert f" {name}" in out
