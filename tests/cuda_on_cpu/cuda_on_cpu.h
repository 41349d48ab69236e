// cuda_on_cpu.h: the CUDA execution model on the host, so CUDA C++ kernel source runs (and is
// tested) on a CPU. Part of minitransformer's test harness (tests/cuda_on_cpu/README.md).
//
// Model. A launch <<<grid, block>>> runs its blocks one after another on the calling thread.
// Each thread of a block is a fiber with its own stack; the scheduler runs one warp (32
// consecutive threads) at a time, each lane until it blocks, so warps meet only where a GPU's
// must: at __syncthreads. Warps run in order 0, 1, ... or in reverse (sim::launch's `order`),
// so a missing __syncthreads between warps shows in one order or the other.
//   __syncthreads()      a block barrier: every thread of the block at the same call
//   __shfl_xor_sync      a warp barrier: every lane of the warp at the same call, values
//                        exchanged through per-lane slots
//   __shared__ arrays    one per block, filled with garbage (all bits set: NaN) at its start
//   float16              exact host conversions (round to nearest, ties to even)
// Errors stop the launch and are reported, not aborted on: a barrier that only part of the
// block reaches (a thread has returned, or threads wait at different __syncthreads), lanes
// of a warp at different shuffles or a shuffle that not every lane reaches, a partial shuffle
// mask, a block that is not whole warps at a shuffle, a block size outside 1..1024. The launch
// returns 1 and sim::error() says what, where (block, thread, source line).
//
// Fibers: made once per launch, each runs the kernel once per block; on x86-64 a stack switch
// is a few instructions (elsewhere ucontext); annotated for AddressSanitizer when it is on.
#pragma once
#include <sys/mman.h>
#include <ucontext.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define SIM_ASAN 1
#else
#define SIM_ASAN 0
#endif

struct uint3 { unsigned x, y, z; };
struct dim3 { unsigned x, y, z; };

#if defined(__x86_64__)
// Switch stacks: push the callee-saved registers, save the stack pointer in *save, load
// `load`, pop, return into the other fiber. A few instructions (swapcontext makes a system
// call for the signal mask each time; the harness switches millions of times).
extern "C" void sim_switch_stacks(void** save, void* load);
asm(".text\n.p2align 4\n.globl sim_switch_stacks\n.hidden sim_switch_stacks\n"
    ".type sim_switch_stacks,@function\nsim_switch_stacks:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  movq %rsp, (%rdi)\n  movq %rsi, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n  ret\n"
    ".size sim_switch_stacks, .-sim_switch_stacks\n");
#define SIM_FAST_SWITCH 1
#else
#define SIM_FAST_SWITCH 0  // elsewhere: ucontext (correct, slower)
#endif

namespace sim {
enum State { RUNNABLE, AT_SYNC, AT_WARP, DONE };
constexpr std::size_t STACK = 256 * 1024;  // per fiber; mapped lazily, reused across launches
constexpr std::size_t GUARD = 4096;        // an inaccessible page below each stack

struct Fiber {
#if SIM_FAST_SWITCH
    void* sp;                     // saved stack pointer while switched out
#else
    ucontext_t ctx;
#endif
    char* stack;
    State state;
    unsigned tid;
    unsigned long long shuffles;  // __shfl_xor_sync calls this lane has completed
    unsigned long long syncs;     // __syncthreads this thread has passed
    int line;                     // source line of the barrier it waits at
#if SIM_ASAN
    void* fake_stack;
#endif
};

struct Run {
    unsigned grid, block, bid;
    int reverse;
    Fiber* fibers;
    Fiber* cur;                          // the fiber running, null in the scheduler
#if SIM_FAST_SWITCH
    void* scheduler_sp;
#else
    ucontext_t scheduler;
#endif
    void (*body)(void*);
    void* args;
    unsigned long long slots[2][1024];   // shuffle exchange, double-buffered by call parity
    unsigned long long switches;
    bool failed;
#if SIM_ASAN
    void* main_fake_stack;
    const void* main_bottom;
    std::size_t main_size;
#endif
};
inline Run* R = nullptr;
inline char error_text[2048];
inline unsigned long long block_serial = 0;

inline std::vector<Fiber>& pool() {
    static std::vector<Fiber> fibers;
    return fibers;
}

// ---- switching ----
// ``abandon``: the fiber is never resumed (a failed launch), so ASan may drop its fake stack.
inline void to_scheduler(bool abandon = false) {
    Fiber* f = R->cur;
    ++R->switches;
#if SIM_ASAN
    __sanitizer_start_switch_fiber(abandon ? nullptr : &f->fake_stack, R->main_bottom,
                                   R->main_size);
#else
    (void)abandon;
#endif
#if SIM_FAST_SWITCH
    sim_switch_stacks(&f->sp, R->scheduler_sp);
#else
    swapcontext(&f->ctx, &R->scheduler);
#endif
#if SIM_ASAN
    __sanitizer_finish_switch_fiber(f->fake_stack, nullptr, nullptr);
#endif
}

// A fiber runs the kernel once per block: the scheduler resumes it for the next block.
inline void fiber_main() {
#if SIM_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &R->main_bottom, &R->main_size);
#endif
    for (;;) {
        R->body(R->args);
        R->cur->state = DONE;
        to_scheduler();
    }
}

// A fresh fiber, entering fiber_main when first resumed. Its stack top is offset by a
// multiple of 64 bytes per thread, so the threads' frames do not all map to the same cache set.
inline void start(Fiber& f, unsigned t) {
    const std::size_t size = STACK - 64 * (t % 61);
#if SIM_ASAN
    ASAN_UNPOISON_MEMORY_REGION(f.stack, STACK);  // a failed launch may have left redzones
#endif
#if SIM_FAST_SWITCH
    auto* top = reinterpret_cast<void**>(
        (reinterpret_cast<std::uintptr_t>(f.stack) + size) & ~std::uintptr_t(15));
    top[-1] = nullptr;                               // fiber_main's return address: none
    top[-2] = reinterpret_cast<void*>(&fiber_main);  // where sim_switch_stacks returns to
    for (int i = 3; i <= 8; ++i) top[-i] = nullptr;  // rbp, rbx, r12..r15
    f.sp = top - 8;
#else
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = size;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_main, 0);
#endif
}

inline void resume(Fiber& f) {
    R->cur = &f;
#if SIM_ASAN
    __sanitizer_start_switch_fiber(&R->main_fake_stack, f.stack, STACK);
#endif
#if SIM_FAST_SWITCH
    sim_switch_stacks(&R->scheduler_sp, f.sp);
#else
    swapcontext(&R->scheduler, &f.ctx);
#endif
#if SIM_ASAN
    __sanitizer_finish_switch_fiber(R->main_fake_stack, nullptr, nullptr);
#endif
    R->cur = nullptr;
}

// ---- errors ----
inline void record(const char* what, const Fiber* f) {
    if (R->failed) return;
    R->failed = true;
    if (f && f->line)
        std::snprintf(error_text, sizeof error_text, "%s (block %u, thread %u, line %d)", what,
                      R->bid, f->tid, f->line);
    else
        std::snprintf(error_text, sizeof error_text, "%s (block %u, thread %u)", what, R->bid,
                      f ? f->tid : 0u);
}
// From inside a fiber: record, then hand control back for good (the launch is abandoned).
[[noreturn]] inline void fail_here(const char* what, int line) {
    R->cur->line = line;
    record(what, R->cur);
    R->cur->state = DONE;
    to_scheduler(true);
    __builtin_unreachable();
}

// ---- the CUDA built-ins ----
inline uint3 thread_idx() { return {R->cur->tid, 0, 0}; }
inline uint3 block_idx() { return {R->bid, 0, 0}; }
inline dim3 block_dim() { return {R->block, 1, 1}; }
inline dim3 grid_dim() { return {R->grid, 1, 1}; }

inline void syncthreads(int line) {
    R->cur->state = AT_SYNC;
    R->cur->line = line;
    to_scheduler();
}

template <typename V> V shfl_xor(unsigned mask, V v, int o, int line) {
    static_assert(sizeof(V) <= 8, "a shuffle of a value wider than 8 bytes");
    if (mask != 0xffffffffu) fail_here("__shfl_xor_sync with a partial mask (not emulated)", line);
    if (R->block % 32) fail_here("__shfl_xor_sync in a block that is not whole warps", line);
    Fiber* f = R->cur;
    unsigned long long* slot = R->slots[f->shuffles & 1];
    std::memcpy(&slot[f->tid], &v, sizeof(V));
    f->state = AT_WARP;
    f->line = line;
    to_scheduler();  // resumed once every lane of the warp has written its value
    const unsigned src = (f->tid & ~31u) | ((f->tid & 31u) ^ ((unsigned)o & 31u));
    V w;
    std::memcpy(&w, &slot[src], sizeof(V));
    ++f->shuffles;
    return w;
}

// ---- one block: every fiber until all are DONE, releasing barriers as they fill ----
inline void run_block() {
    const unsigned n = R->block, warps = (n + 31) / 32;
    ++block_serial;
    for (unsigned t = 0; t < n; ++t) {
        Fiber& f = R->fibers[t];
        f.state = RUNNABLE;
        f.tid = t;
        f.shuffles = f.syncs = 0;
        f.line = 0;
    }
    for (;;) {
        for (unsigned k = 0; k < warps; ++k) {
            const unsigned w = R->reverse ? warps - 1 - k : k;
            const unsigned lo = w * 32, hi = lo + 32 < n ? lo + 32 : n;
            for (;;) {  // this warp as far as it goes
                for (unsigned t = lo; t < hi; ++t) {
                    if (R->fibers[t].state != RUNNABLE) continue;
                    resume(R->fibers[t]);
                    if (R->failed) return;
                }
                unsigned at_warp = 0;
                for (unsigned t = lo; t < hi; ++t) at_warp += R->fibers[t].state == AT_WARP;
                if (at_warp == 0 || at_warp != hi - lo) break;  // a lane elsewhere: see below
                for (unsigned t = lo + 1; t < hi; ++t)
                    if (R->fibers[t].shuffles != R->fibers[lo].shuffles ||
                        R->fibers[t].line != R->fibers[lo].line) {
                        record("lanes of a warp at different __shfl_xor_sync calls "
                               "(divergent shuffle)", &R->fibers[t]);
                        return;
                    }
                for (unsigned t = lo; t < hi; ++t) R->fibers[t].state = RUNNABLE;
            }
        }
        unsigned done = 0, at_sync = 0;
        for (unsigned t = 0; t < n; ++t) {
            done += R->fibers[t].state == DONE;
            at_sync += R->fibers[t].state == AT_SYNC;
        }
        if (done == n) return;
        for (unsigned t = 0; t < n; ++t)
            if (R->fibers[t].state == AT_WARP) {  // and some lane of its warp is not
                const unsigned lo = t & ~31u, hi = lo + 32 < n ? lo + 32 : n;
                std::string what = "a __shfl_xor_sync that not every lane of the warp reaches";
                for (unsigned u = lo; u < hi; ++u)
                    if (R->fibers[u].state == AT_SYNC) {
                        what += ": lane " + std::to_string(u - lo) + " waits at __syncthreads "
                                "(line " + std::to_string(R->fibers[u].line) + "), a divergent "
                                "barrier or a deadlock";
                        break;
                    } else if (R->fibers[u].state == DONE) {
                        what += ": lane " + std::to_string(u - lo) + " has returned";
                        break;
                    }
                record(what.c_str(), &R->fibers[t]);
                return;
            }
        if (done) {
            for (unsigned t = 0; t < n; ++t)
                if (R->fibers[t].state == AT_SYNC) {
                    record("__syncthreads reached by only part of the block: other threads "
                           "have returned (a barrier inside a branch?)", &R->fibers[t]);
                    return;
                }
        }
        for (unsigned t = 1; t < n; ++t)
            if (R->fibers[t].syncs != R->fibers[0].syncs ||
                R->fibers[t].line != R->fibers[0].line) {
                std::string what = "threads of a block wait at different __syncthreads (line " +
                                   std::to_string(R->fibers[0].line) + " for thread 0): a "
                                   "divergent barrier";
                record(what.c_str(), &R->fibers[t]);
                return;
            }
        for (unsigned t = 0; t < n; ++t) {  // all at the same __syncthreads: release
            R->fibers[t].state = RUNNABLE;
            ++R->fibers[t].syncs;
        }
    }
}

// launch<<<grid, block>>>: body(args) is the kernel call every thread makes. 0 when it ran
// through, 1 after an error (sim::error_text says which).
inline int launch(unsigned grid, unsigned block, int reverse, void (*body)(void*), void* args) {
    error_text[0] = 0;
    if (block == 0 || block > 1024) {
        std::snprintf(error_text, sizeof error_text, "block size %u: must be 1..1024", block);
        return 1;
    }
    std::vector<Fiber>& fibers = pool();
    while (fibers.size() < block) {
        fibers.emplace_back();
        // a stack and, below it, a guard page: an overflow faults instead of writing into
        // the neighbouring thread's stack
        char* p = static_cast<char*>(mmap(nullptr, STACK + GUARD, PROT_READ | PROT_WRITE,
                                          MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
        if (p == MAP_FAILED || mprotect(p, GUARD, PROT_NONE) != 0) {
            fibers.pop_back();
            std::snprintf(error_text, sizeof error_text, "no memory for %u fiber stacks", block);
            return 1;
        }
        fibers.back().stack = p + GUARD;
    }
    static Run run;  // large (the shuffle slots): not on the caller's stack
    Run* saved = R;
    run = Run{};
    run.grid = grid;
    run.block = block;
    run.reverse = reverse;
    run.fibers = fibers.data();
    run.body = body;
    run.args = args;
    R = &run;
    for (unsigned t = 0; t < block; ++t) start(fibers[t], t);  // none left mid-way
    for (unsigned b = 0; b < grid && !run.failed; ++b) {
        run.bid = b;
        run_block();
    }
    R = saved;
    return run.failed ? 1 : 0;
}

inline void poison_shared_once(void* p, std::size_t n) {
    static std::unordered_map<void*, unsigned long long> seen;  // array -> block last poisoned
    unsigned long long& b = seen[p];
    if (b != block_serial) {
        std::memset(p, 0xff, n);
        b = block_serial;
    }
}
inline float int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline double longlong_as_double(long long i) { double d; std::memcpy(&d, &i, 8); return d; }
inline float f16_bits_to_float(unsigned short b) { _Float16 h; std::memcpy(&h, &b, 2); return (float)h; }
inline unsigned short float_to_f16_bits_rn(float a) {  // cvt.rn.f16.f32
    _Float16 h = (_Float16)a;
    unsigned short b;
    std::memcpy(&b, &h, 2);
    return b;
}

// ---- an entry point per kernel: its signature (checked by the caller) and its launcher ----
template <typename V> void describe_value(std::string& s) {
    if constexpr (std::is_same_v<V, bool>) s += 'b';
    else if constexpr (std::is_floating_point_v<V>) s += 'f';
    else if constexpr (std::is_integral_v<V>) s += std::is_signed_v<V> ? 'i' : 'u';
    else s += 's';  // a struct, e.g. f16
    s += std::to_string(sizeof(V));
}
template <typename P> void describe(std::string& s) {
    using U = std::remove_cv_t<std::remove_reference_t<P>>;
    if (!s.empty()) s += ' ';
    if constexpr (std::is_pointer_v<U>) {
        s += '*';
        describe_value<std::remove_cv_t<std::remove_pointer_t<U>>>(s);
    } else {
        describe_value<U>(s);
    }
}
template <typename... P> std::string signature(void (*)(P...)) {
    std::string s;
    (describe<P>(s), ...);
    return s;
}
template <typename... P, std::size_t... I>
void call(void (*f)(P...), void** a, std::index_sequence<I...>) {
    f(*static_cast<std::remove_cv_t<std::remove_reference_t<P>>*>(a[I])...);
}
template <typename... P> constexpr std::size_t arity(void (*)(P...)) { return sizeof...(P); }
template <auto F> void body(void* a) {
    call(F, static_cast<void**>(a), std::make_index_sequence<arity(F)>{});
}
}  // namespace sim

extern "C" const char* sim_error() { return sim::error_text; }

// ---- the CUDA names the kernel source uses ----
#define __global__
#define __device__
#define __forceinline__ inline
// products rounded on their own: never contracted with a following sum into an FMA (the
// compiler contracts elsewhere, as NVRTC does; kernels.py)
__attribute__((noinline)) inline float __fmul_rn(float a, float b) { return a * b; }
__attribute__((noinline)) inline double __dmul_rn(double a, double b) { return a * b; }
// `__shared__ T name[N];` is rewritten by the harness (kernels.py) into a static array that
// the first thread of each block to reach it poisons; any other use is a plain static.
#define __shared__ static
#define threadIdx (sim::thread_idx())
#define blockIdx (sim::block_idx())
#define blockDim (sim::block_dim())
#define gridDim (sim::grid_dim())
#define __syncthreads() sim::syncthreads(__LINE__)
#define __shfl_xor_sync(mask, v, o) sim::shfl_xor((mask), (v), (o), __LINE__)
#define __int_as_float(i) sim::int_as_float((int)(i))
#define __longlong_as_double(i) sim::longlong_as_double((long long)(i))
using std::exp;
using std::isfinite;
using std::log;
using std::sqrt;
