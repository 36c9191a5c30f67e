// epd_handoff_probe: what one stream-ordered hand-off costs between a "client" stream and a
// "daemon" stream on one GPU, in two processes (under MPS) or one. No epd code: the pattern
// of a daemon-launched low-latency op reduced to its hops, 8 ranks, stamped with
// %globaltimer. A scratch-grade tool: any CUDA error ends it with a message.
//
//   epd_handoff_probe MODE [ITERS=500]     (env PROBE_BLOCKS: blocks per "LL" kernel, 16)
//
// The modes, what is printed and the figures: docs/BENCHMARKS.md "Hand-off".
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "tests/common/cuda_or_die.h"

#define CU(x)                                                             \
  do {                                                                    \
    CUresult r_ = (x);                                                    \
    if (r_ != CUDA_SUCCESS) {                                             \
      fprintf(stderr, "%s:%d %s: %d\n", __FILE__, __LINE__, #x, (int)r_); \
      exit(1);                                                            \
    }                                                                     \
  } while (0)

constexpr int R = 8, THREADS = 1024;
int BLOCKS = 16;
constexpr size_t XBYTES = 128 * 7168 * 2;
constexpr int MAXIT = 4096;
constexpr int SMEM = 160 * 1024;

struct Shared {
  unsigned long long ready[R][8];
  unsigned long long done[R][8];
  unsigned long long arrive[8];
  unsigned long long finished[R][8];
  unsigned long long copied[R][8];
  long long stamps[MAXIT][R][4];
};

__device__ __forceinline__ long long gt() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned long long ld_acq(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_rel(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__global__ void stamp_kernel(Shared* s, int it, int r, int slot) { s->stamps[it][r][slot] = gt(); }

__global__ void copy_kernel(const int4* __restrict__ src, int4* __restrict__ dst, size_t n,
                            unsigned long long* cnt, unsigned long long* ready, int it) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    dst[i] = src[i];
  if (ready == nullptr) return;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    unsigned long long old = atomicAdd(cnt, 1ull);
    if (old == (unsigned long long)it * gridDim.x - 1) st_rel(ready, it);
  }
}
__global__ void spinner_kernel(const unsigned long long* flag, unsigned long long v, int trigger) {
  if (threadIdx.x == 0) {
    long long t0 = gt();
    while (ld_acq(flag) < v && gt() - t0 < 2000000000LL) {
    }
  }
  __syncthreads();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (trigger) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__global__ void bounded_spinner(const unsigned long long* flag, unsigned long long v,
                                long long ns) {
  long long t0 = gt();
  while (ld_acq(flag) < v && gt() - t0 < ns) {
  }
}
__global__ void signal_kernel(unsigned long long* ready, int it) { st_rel(ready, it); }

// spin_ready: wait for ready[r] >= it in-kernel; kdone: last block writes done[r] = it.
__global__ void __launch_bounds__(THREADS, 1)
    ll_kernel(Shared* s, const int4* __restrict__ src, int4* __restrict__ dst, int it, int r,
              int spin_ready, int kdone) {
  const int BLOCKS = gridDim.x;
  extern __shared__ char smem[];
  if (threadIdx.x == 0) {
    if (spin_ready) {
      long long t0 = gt();
      while (ld_acq(&s->ready[r][0]) < (unsigned long long)it && gt() - t0 < 2000000000LL) {
      }
    }
    if (blockIdx.x == 0) s->stamps[it][r][1] = gt();
    __threadfence();
    atomicAdd(&s->arrive[0], 1ull);
    long long t0 = gt();
    while (ld_acq(&s->arrive[0]) < (unsigned long long)it * R * BLOCKS &&
           gt() - t0 < 2000000000LL) {
    }
    smem[0] = 1;
  }
  __syncthreads();
  size_t n = XBYTES / 16, per = n / BLOCKS;
  for (size_t i = blockIdx.x * per + threadIdx.x; i < (blockIdx.x + 1) * per; i += blockDim.x)
    dst[i] = src[i];
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    unsigned long long old = atomicAdd(&s->finished[r][0], 1ull);
    if (old == (unsigned long long)it * BLOCKS - 1) {
      s->stamps[it][r][2] = gt();
      if (kdone) {
        __threadfence_system();
        st_rel(&s->done[r][0], it);
      }
    }
  }
}

__global__ void rb_kernel(Shared* s, int* out, int r, int it, int write_done) {
  out[r] = (int)s->finished[r][0];
  if (write_done) {
    __threadfence_system();
    st_rel(&s->done[r][0], it);
  }
}

CUresult (*pWait)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
CUresult (*pWrite)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
void resolve() {
  cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPointByVersion("cuStreamWaitValue64", (void**)&pWait, 12000,
                                      cudaEnableDefault, &q));
  CK(cudaGetDriverEntryPointByVersion("cuStreamWriteValue64", (void**)&pWrite, 12000,
                                      cudaEnableDefault, &q));
}
void waitv(cudaStream_t st, void* p, unsigned long long v) {
  CU(pWait((CUstream)st, (CUdeviceptr)p, v, CU_STREAM_WAIT_VALUE_GEQ));
}
void writev(cudaStream_t st, void* p, unsigned long long v) {
  CU(pWrite((CUstream)st, (CUdeviceptr)p, v, CU_STREAM_WRITE_VALUE_DEFAULT));
}

struct DaemonBufs {
  Shared* s;
  char* staged;  // R * XBYTES
  char* out;     // R * XBYTES
  int* rb;
};
struct IpcMsg {
  cudaIpcMemHandle_t s, staged;
};
struct EvMsg {
  cudaIpcEventHandle_t ev[R];
};

cudaEvent_t g_ev[R];
void daemon_enqueue(const std::string& mode, DaemonBufs& b, cudaStream_t* st, int it) {
  bool spin = mode.rfind("spin", 0) == 0;
  bool kdone =
      spin || mode == "memop_kdone" || mode.rfind("kd", 0) == 0 || mode.rfind("ip_kd", 0) == 0;
  bool ev = mode == "kd_ev";
  bool sp = mode.rfind("sp_", 0) == 0 || mode.rfind("spp_", 0) == 0;
  bool pdl = mode.rfind("spp_", 0) == 0;
  if (sp) {
    spin = true;
    kdone = true;
  }
  bool rbk = mode == "memop_rbk";
  for (int r = 0; r < R; ++r) {
    if (ev)
      CK(cudaStreamWaitEvent(st[r], g_ev[r], 0));
    else if (!spin)
      waitv(st[r], &b.s->ready[r][0], it);
    if (sp) spinner_kernel<<<1, 32, 0, st[r]>>>(&b.s->ready[r][0], it, pdl);
    if (pdl) {
      cudaLaunchConfig_t cfg{};
      cfg.gridDim = BLOCKS;
      cfg.blockDim = THREADS;
      cfg.dynamicSmemBytes = SMEM;
      cfg.stream = st[r];
      cudaLaunchAttribute at[1];
      at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      at[0].val.programmaticStreamSerializationAllowed = 1;
      cfg.attrs = at;
      cfg.numAttrs = 1;
      CK(cudaLaunchKernelEx(&cfg, ll_kernel, b.s, (const int4*)(b.staged + r * XBYTES),
                            (int4*)(b.out + r * XBYTES), it, r, 1, 1));
    } else {
      ll_kernel<<<BLOCKS, THREADS, SMEM, st[r]>>>(b.s, (const int4*)(b.staged + r * XBYTES),
                                                  (int4*)(b.out + r * XBYTES), it, r, spin, kdone);
    }
    if (!kdone) {
      rb_kernel<<<1, 1, 0, st[r]>>>(b.s, b.rb, r, it, rbk);
      if (!rbk) writev(st[r], &b.s->done[r][0], it);
    }
  }
}

int main(int argc, char** argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: epd_handoff_probe MODE [ITERS] (modes: see the source header)\n");
    return 2;
  }
  std::string mode = argc > 1 ? argv[1] : "memop";
  int iters = argc > 2 ? atoi(argv[2]) : 500;
  if (getenv("PROBE_BLOCKS")) BLOCKS = atoi(getenv("PROBE_BLOCKS"));
  const int warm = 50;
  bool two = mode.rfind("memop", 0) == 0 || mode.rfind("spin", 0) == 0 ||
             mode.rfind("kd", 0) == 0 || mode.rfind("sp_", 0) == 0 || mode.rfind("spp_", 0) == 0;
  bool csp = mode.find("csp") != std::string::npos;
  bool ip = mode.rfind("ip_", 0) == 0;
  bool sig = mode.find("sig") != std::string::npos;
  bool nocopy = mode == "inproc" || mode.find("nocopy") != std::string::npos;
  int to_d[2], to_c[2];
  pipe(to_d);
  pipe(to_c);
  pid_t pid = two ? fork() : 1;
  if (pid == 0) {  // daemon
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 1);
    resolve();
    CK(cudaFuncSetAttribute(ll_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
    DaemonBufs b;
    CK(cudaMalloc(&b.s, sizeof(Shared)));
    CK(cudaMemset(b.s, 0, sizeof(Shared)));
    CK(cudaMalloc(&b.staged, R * XBYTES));
    CK(cudaMalloc(&b.out, R * XBYTES));
    CK(cudaMalloc(&b.rb, 64));
    cudaStream_t st[R];
    for (auto& x : st) CK(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking));
    CK(cudaDeviceSynchronize());
    IpcMsg m;
    CK(cudaIpcGetMemHandle(&m.s, b.s));
    CK(cudaIpcGetMemHandle(&m.staged, b.staged));
    write(to_c[1], &m, sizeof m);
    if (mode == "kd_ev") {
      EvMsg em;
      read(to_d[0], &em, sizeof em);
      for (int r = 0; r < R; ++r) CK(cudaIpcOpenEventHandle(&g_ev[r], em.ev[r]));
    }
    int it;
    while (read(to_d[0], &it, sizeof it) == sizeof it && it > 0) {
      daemon_enqueue(mode, b, st, it);
      write(to_c[1], &it, sizeof it);
    }
    CK(cudaDeviceSynchronize());
    _exit(0);
  }
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 1);
  resolve();
  CK(cudaFuncSetAttribute(ll_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
  Shared* s;
  char* staged;
  DaemonBufs local{};
  if (two) {
    IpcMsg m;
    read(to_c[0], &m, sizeof m);
    CK(cudaIpcOpenMemHandle((void**)&s, m.s, cudaIpcMemLazyEnablePeerAccess));
    CK(cudaIpcOpenMemHandle((void**)&staged, m.staged, cudaIpcMemLazyEnablePeerAccess));
  } else {
    CK(cudaMalloc(&s, sizeof(Shared)));
    CK(cudaMemset(s, 0, sizeof(Shared)));
    CK(cudaMalloc(&staged, R * XBYTES));
    local.s = s;
    local.staged = staged;
    CK(cudaMalloc(&local.out, R * XBYTES));
    CK(cudaMalloc(&local.rb, 64));
  }
  char* x;
  CK(cudaMalloc(&x, R * XBYTES));
  CK(cudaMemset(x, 1, R * XBYTES));
  unsigned long long* gate;
  CK(cudaHostAlloc(&gate, 64, cudaHostAllocMapped));
  *gate = 0;
  unsigned long long* gate_d;
  CK(cudaHostGetDevicePointer((void**)&gate_d, gate, 0));
  cudaStream_t st[R], dst_[R];
  for (auto& y : st) CK(cudaStreamCreateWithFlags(&y, cudaStreamNonBlocking));
  for (auto& y : dst_) CK(cudaStreamCreateWithFlags(&y, cudaStreamNonBlocking));
  if (mode == "kd_ev") {
    EvMsg em;
    for (int r = 0; r < R; ++r) {
      CK(cudaEventCreateWithFlags(&g_ev[r], cudaEventDisableTiming | cudaEventInterprocess));
      CK(cudaIpcGetEventHandle(&em.ev[r], g_ev[r]));
    }
    write(to_d[1], &em, sizeof em);
  }
  CK(cudaDeviceSynchronize());
  int total = warm + iters;
  for (int it = 1; it <= total; ++it) {
    for (int r = 0; r < R; ++r) {
      waitv(st[r], gate_d, it);
      stamp_kernel<<<1, 1, 0, st[r]>>>(s, it, r, 0);
      if (!nocopy)
        copy_kernel<<<32, 512, 0, st[r]>>>((const int4*)(x + r * XBYTES),
                                           (int4*)(staged + r * XBYTES), XBYTES / 16,
                                           &s->copied[r][0], sig ? &s->ready[r][0] : nullptr, it);
      else if (sig)
        signal_kernel<<<1, 1, 0, st[r]>>>(&s->ready[r][0], it);
      if (two || ip) {
        if (mode == "kd_ev")
          CK(cudaEventRecord(g_ev[r], st[r]));
        else if (!sig)
          writev(st[r], &s->ready[r][0], it);
        if (mode.find("cspw") != std::string::npos) {
          bounded_spinner<<<1, 32, 0, st[r]>>>(&s->done[r][0], it, 200000);
          waitv(st[r], &s->done[r][0], it);
        } else if (csp)
          spinner_kernel<<<1, 32, 0, st[r]>>>(&s->done[r][0], it, 0);
        else
          waitv(st[r], &s->done[r][0], it);
      } else {
        const char* src = mode == "inproc" ? x : staged;
        ll_kernel<<<BLOCKS, THREADS, SMEM, st[r]>>>(s, (const int4*)(src + r * XBYTES),
                                                    (int4*)(local.out + r * XBYTES), it, r, 0, 0);
      }
      stamp_kernel<<<1, 1, 0, st[r]>>>(s, it, r, 3);
    }
    if (ip) daemon_enqueue(mode, local, dst_, it);
    if (two) {
      write(to_d[1], &it, sizeof it);
      int ack;
      read(to_c[0], &ack, sizeof ack);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(600));
    __atomic_store_n(gate, (unsigned long long)it, __ATOMIC_SEQ_CST);
    for (auto& y : st) CK(cudaStreamSynchronize(y));
  }
  if (two) {
    int z = 0;
    write(to_d[1], &z, sizeof z);
  }
  std::vector<long long> h(MAXIT * R * 4);
  CK(cudaMemcpy(h.data(), s->stamps, sizeof(long long) * MAXIT * R * 4, cudaMemcpyDeviceToHost));
  std::vector<double> tot, in_lat, kern, out_lat, t1spread;
  for (int it = warm + 1; it <= total; ++it) {
    long long* p = &h[(size_t)it * R * 4];
    long long t0min = 1LL << 62, t3max = 0, t1min = 1LL << 62, t1max = 0, t2max = 0;
    for (int r = 0; r < R; ++r) {
      t0min = std::min(t0min, p[r * 4 + 0]);
      t3max = std::max(t3max, p[r * 4 + 3]);
      t1min = std::min(t1min, p[r * 4 + 1]);
      t1max = std::max(t1max, p[r * 4 + 1]);
      t2max = std::max(t2max, p[r * 4 + 2]);
    }
    tot.push_back((t3max - t0min) / 1e3);
    in_lat.push_back((t1max - t0min) / 1e3);
    t1spread.push_back((t1max - t1min) / 1e3);
    kern.push_back((t2max - t1max) / 1e3);
    out_lat.push_back((t3max - t2max) / 1e3);
  }
  auto pct = [](std::vector<double> v, double q) {
    std::sort(v.begin(), v.end());
    return v[(size_t)(q * (v.size() - 1))];
  };
  printf(
      "%-14s total p50 %7.1f p99 %7.1f | t0->last LL entry %6.1f (entry spread %5.1f) | "
      "LL %6.1f | last LL exit->last t3 %6.1f  (us)\n",
      mode.c_str(), pct(tot, .5), pct(tot, .99), pct(in_lat, .5), pct(t1spread, .5), pct(kern, .5),
      pct(out_lat, .5));
  if (two) waitpid(pid, nullptr, 0);
  return 0;
}
