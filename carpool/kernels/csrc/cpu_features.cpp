// What this CPU can run, read once at import to choose among the kernel builds (carpool/kernels/isa.py).
// Built without -march and with no torch, as its own tiny module (carpool.kernels._cpu_features): it must load
// on every CPU, and before any kernel module does (each of those registers torch.ops.carpool, so only one loads).
//
// A feature counts only when the CPU lists it (CPUID) AND the OS saves its registers (XCR0), as Linux's
// /proc/cpuinfo does. AMX additionally needs a per-process permission and, on some of this project's VMs, faults
// although all of that says yes, so it is finally decided by running one tile multiply in a forked child.
#include <Python.h>

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__linux__)  // CPUID, XCR0, and Linux's arch_prctl for AMX
#include <cpuid.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <initializer_list>

namespace {

struct Bit {
  const char* name;  // as /proc/cpuinfo spells it (lzcnt, which cpuinfo folds into "abm", excepted)
  unsigned leaf, subleaf;
  int reg;  // 0 eax, 1 ebx, 2 ecx, 3 edx
  int bit;
  uint64_t xcr0;  // state components the OS must enable for the feature's registers
};

constexpr uint64_t kYmm = 0x6;           // SSE + AVX state
constexpr uint64_t kZmm = 0xE6;          // + opmask, ZMM_Hi256, Hi16_ZMM
constexpr uint64_t kTiles = 0x60000;     // XTILECFG + XTILEDATA

constexpr Bit kBits[] = {
    {"sse3", 1, 0, 2, 0, 0},           {"ssse3", 1, 0, 2, 9, 0},        {"fma", 1, 0, 2, 12, kYmm},
    {"cx16", 1, 0, 2, 13, 0},          {"sse4_1", 1, 0, 2, 19, 0},      {"sse4_2", 1, 0, 2, 20, 0},
    {"movbe", 1, 0, 2, 22, 0},         {"popcnt", 1, 0, 2, 23, 0},      {"xsave", 1, 0, 2, 26, 0},
    {"avx", 1, 0, 2, 28, kYmm},        {"f16c", 1, 0, 2, 29, kYmm},     {"bmi1", 7, 0, 1, 3, 0},
    {"avx2", 7, 0, 1, 5, kYmm},        {"bmi2", 7, 0, 1, 8, 0},         {"avx512f", 7, 0, 1, 16, kZmm},
    {"avx512dq", 7, 0, 1, 17, kZmm},   {"avx512cd", 7, 0, 1, 28, kZmm}, {"avx512bw", 7, 0, 1, 30, kZmm},
    {"avx512vl", 7, 0, 1, 31, kZmm},   {"avx512_vnni", 7, 0, 2, 11, kZmm},
    {"amx_bf16", 7, 0, 3, 22, kTiles}, {"avx512_fp16", 7, 0, 3, 23, kZmm}, {"amx_tile", 7, 0, 3, 24, kTiles},
    {"amx_int8", 7, 0, 3, 25, kTiles}, {"avx_vnni", 7, 1, 0, 4, kYmm},  {"avx512_bf16", 7, 1, 0, 5, kZmm},
    {"lahf_lm", 0x80000001, 0, 2, 0, 0}, {"lzcnt", 0x80000001, 0, 2, 5, 0},
};

uint64_t os_enabled_state() {
  unsigned regs[4];
  if (!__get_cpuid(1, &regs[0], &regs[1], &regs[2], &regs[3]) || !(regs[2] & (1u << 27))) return 0;  // no OSXSAVE
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

PyObject* features(PyObject*, PyObject*) {
  const uint64_t xcr0 = os_enabled_state();
  PyObject* names = PyList_New(0);
  if (!names) return nullptr;
  for (const Bit& b : kBits) {
    unsigned regs[4];
    if (!__get_cpuid_count(b.leaf, b.subleaf, &regs[0], &regs[1], &regs[2], &regs[3])) continue;
    if (!(regs[b.reg] & (1u << b.bit)) || (xcr0 & b.xcr0) != b.xcr0) continue;
    PyObject* name = PyUnicode_FromString(b.name);
    if (!name || PyList_Append(names, name) < 0) {
      Py_XDECREF(name);
      Py_DECREF(names);
      return nullptr;
    }
    Py_DECREF(name);
  }
  return names;
}

PyObject* cpu_model(PyObject*, PyObject*) {
  unsigned brand[12] = {};
  for (unsigned i = 0; i < 3; ++i)
    if (!__get_cpuid(0x80000002 + i, &brand[4 * i], &brand[4 * i + 1], &brand[4 * i + 2], &brand[4 * i + 3]))
      return PyUnicode_FromString("");
  char text[49] = {};
  std::memcpy(text, brand, 48);
  return PyUnicode_FromString(text);
}

// CPUID leaf 1's family, model and stepping, as the OS reports them (/proc/cpuinfo): a VM's brand string is often
// just "AMD EPYC", and family 25 model 1 (Zen 3) and model 17 (Zen 4) differ in ways every figure depends on.
PyObject* cpu_signature(PyObject*, PyObject*) {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) Py_RETURN_NONE;
  const unsigned base_family = (eax >> 8) & 0xF, base_model = (eax >> 4) & 0xF;
  const unsigned family = base_family == 0xF ? base_family + ((eax >> 20) & 0xFF) : base_family;
  const unsigned extended_model = ((eax >> 16) & 0xF) << 4;
  const unsigned model = base_family == 0x6 || base_family == 0xF ? extended_model | base_model : base_model;
  return Py_BuildValue("(III)", family, model, eax & 0xF);
}

// Linux keeps AMX tile data off until a process asks for it (kernel 5.16+); without it the first tile
// instruction faults. Children forked afterwards inherit the permission.
PyObject* request_tile_permission(PyObject*, PyObject*) {
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0) Py_RETURN_NONE;
  return PyUnicode_FromFormat("arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) failed: %s", std::strerror(errno));
}

// A 16x32 by 32x16 bf16 tile product (ones times twos: every result is 64) in raw instructions, so the module
// needs no AMX compiler flags and runs only what is probed: ldtilecfg, tilezero, tileloadd, tdpbf16ps,
// tilestored, tilerelease.
bool tile_multiply_gives_64() {
  struct alignas(64) TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } config = {};
  config.palette = 1;
  for (int t = 0; t < 3; ++t) config.rows[t] = 16, config.colsb[t] = 64;  // tmm0 C fp32, tmm1 A bf16, tmm2 B bf16
  alignas(64) uint16_t a[16 * 32], b[16 * 32];
  alignas(64) float c[16 * 16];
  for (int i = 0; i < 16 * 32; ++i) a[i] = 0x3F80, b[i] = 0x4000;  // bf16 1.0 and 2.0
  const long stride = 64;
  __asm__ volatile("ldtilecfg %0" : : "m"(config));
  __asm__ volatile("tilezero %%tmm0" : :);
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm1" : : "r"(a), "r"(stride) : "memory");
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm2" : : "r"(b), "r"(stride) : "memory");
  __asm__ volatile("tdpbf16ps %%tmm2, %%tmm1, %%tmm0" : :);
  __asm__ volatile("tilestored %%tmm0, (%0,%1,1)" : : "r"(c), "r"(stride) : "memory");
  __asm__ volatile("tilerelease" : :);
  for (float v : c)
    if (v != 64.0f) return false;
  return true;
}

// Runs the tile multiply in a forked child, so a fault (SIGILL on a CPU without AMX, SIGSEGV or SIGILL where a
// hypervisor hides the tile state) kills the child, not the server. None when it ran and was right, else why not.
PyObject* tile_multiply_in_child(PyObject*, PyObject*) {
  const pid_t child = fork();
  if (child < 0) return PyUnicode_FromFormat("fork failed: %s", std::strerror(errno));
  if (child == 0) {  // only async-signal-safe work in the child
    // The default actions, not the parent's handlers (Python's faulthandler would print a "fatal error").
    for (int sig : {SIGILL, SIGSEGV, SIGBUS, SIGFPE}) std::signal(sig, SIG_DFL);
    _exit(tile_multiply_gives_64() ? 0 : 1);
  }
  int status = 0;
  pid_t waited;
  Py_BEGIN_ALLOW_THREADS
  do waited = waitpid(child, &status, 0);
  while (waited < 0 && errno == EINTR);
  Py_END_ALLOW_THREADS
  if (waited < 0) return PyUnicode_FromFormat("waitpid failed: %s", std::strerror(errno));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return PyUnicode_FromFormat("tile multiply killed by signal %d (%s)", sig, strsignal(sig));
  }
  if (WEXITSTATUS(status) != 0) return PyUnicode_FromString("tile multiply ran but gave wrong results");
  Py_RETURN_NONE;
}

}  // namespace
#else
namespace {
PyObject* features(PyObject*, PyObject*) { return PyList_New(0); }
PyObject* cpu_model(PyObject*, PyObject*) { return PyUnicode_FromString(""); }
PyObject* cpu_signature(PyObject*, PyObject*) { Py_RETURN_NONE; }
constexpr const char* kNoProbe = "the AMX probe needs Linux on x86-64";
PyObject* request_tile_permission(PyObject*, PyObject*) { return PyUnicode_FromString(kNoProbe); }
PyObject* tile_multiply_in_child(PyObject*, PyObject*) { return PyUnicode_FromString(kNoProbe); }
}  // namespace
#endif

static PyMethodDef kMethods[] = {
    {"features", features, METH_NOARGS, "x86 features the CPU lists and the OS enables, /proc/cpuinfo names"},
    {"cpu_model", cpu_model, METH_NOARGS, "the CPU's brand string ('' where CPUID has none)"},
    {"cpu_signature", cpu_signature, METH_NOARGS, "CPUID's (family, model, stepping), or None off x86"},
    {"request_tile_permission", request_tile_permission, METH_NOARGS, "None, or why AMX tile data is not allowed"},
    {"tile_multiply_in_child", tile_multiply_in_child, METH_NOARGS, "None, or why a bf16 tile multiply failed"},
    {nullptr, nullptr, 0, nullptr},
};

static PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_cpu_features", "CPU feature detection for carpool's kernels",
                              -1, kMethods};

PyMODINIT_FUNC PyInit__cpu_features() { return PyModule_Create(&kModule); }
