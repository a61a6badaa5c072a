"""Builds carpool's C++ CPU kernels (a torch extension) at install; everything else is in pyproject.toml."""

from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

# -march=native: the package is built on the machine that serves, like llama.cpp's default native build,
# so the kernels use whatever vector units this CPU has (AVX-512, AVX512-BF16) and stay portable C++ elsewhere.
# -ffp-contract=off: no silent FMA contraction, so the portable loops round where gguf-py and torch round.
setup(
    ext_modules=[
        CppExtension(
            "carpool.kernels._C",
            sorted(str(p) for p in Path("carpool/kernels/csrc").glob("*.cpp")),
            extra_compile_args=["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-std=c++20"],
            extra_link_args=["-fopenmp"],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=False)},
)
