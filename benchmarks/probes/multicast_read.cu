// Groups of CTAs reading the same slice of a buffer into shared memory by cp.async.bulk (the shared
// attention kernel's K/V tiles, which every row tile of a KV head reads): each CTA its own copy, or,
// in clusters of CLUSTER CTAs, one CTA's copy multicast to the cluster (one L2 read for CLUSTER
// deliveries). A 4-deep ring of 16 KB slots; a slot frees once every CTA of the cluster has read it
// (each CTA's "empty" barrier counts every CTA's release); 128 consumer threads xor each slot into a
// register so the reads are used. benchmarks/probes/multicast_energy.py compiles and launches it.
#include <cstdint>
#define STAGES 4
#define CHUNK 16384
#define CONSUMERS 128
#ifndef CLUSTER
#define CLUSTER 2
#endif

__device__ __forceinline__ uint32_t sa(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(uint64_t* b, uint32_t n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(sa(b)), "r"(n) : "memory");
}
__device__ __forceinline__ void mbar_expect(uint64_t* b, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(sa(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t parity) {
  asm volatile("{\n .reg .pred p;\n W_%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W_%=;\n}"
               :: "r"(sa(b)), "r"(parity) : "memory");
}
__device__ __forceinline__ void mbar_arrive_in(uint64_t* b, uint32_t cta) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(sa(b)), "r"(cta));
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" :: "r"(remote) : "memory");
}
__device__ __forceinline__ void bulk(void* dst, const void* src, uint64_t* b) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(sa(dst)), "l"(src), "r"(CHUNK), "r"(sa(b)) : "memory");
}
__device__ __forceinline__ void bulk_mc(void* dst, const void* src, uint64_t* b) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], %4;"
               :: "r"(sa(dst)), "l"(src), "r"(CHUNK), "r"(sa(b)), "h"((uint16_t)((1 << CLUSTER) - 1)) : "memory");
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

extern "C" __global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(CONSUMERS + 32)
group_read(const unsigned char* __restrict__ x, uint32_t* out, long long slice_bytes, int reps, int group, int multicast) {
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + STAGES * CHUNK);
  uint64_t* empty = full + STAGES;
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  const int tid = threadIdx.x;
  const long long slice = blockIdx.x / group;
  const unsigned char* base = x + slice * slice_bytes;
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) { mbar_init(&full[s], 1); mbar_init(&empty[s], CLUSTER); }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  cluster_sync();
  const long long chunks = slice_bytes / CHUNK, total = chunks * reps;
  if (tid >= CONSUMERS) {
    if (tid == CONSUMERS) {
      for (long long c = 0; c < total; ++c) {
        const int s = c % STAGES;
        const uint32_t parity = ((c / STAGES) & 1) ^ 1;
        mbar_wait(&empty[s], parity);  // both CTAs done with the slot's last chunk
        mbar_expect(&full[s], CHUNK);
        const unsigned char* src = base + (c % chunks) * CHUNK;
        if (multicast) {
          if ((uint32_t)(c % CLUSTER) == rank) bulk_mc(smem + s * CHUNK, src, &full[s]);
        } else {
          bulk(smem + s * CHUNK, src, &full[s]);
        }
      }
    }
  } else {
    uint32_t acc = 0;
    for (long long c = 0; c < total; ++c) {
      const int s = c % STAGES;
      mbar_wait(&full[s], (c / STAGES) & 1);
      const uint4* p = reinterpret_cast<const uint4*>(smem + s * CHUNK);
#pragma unroll
      for (int i = 0; i < CHUNK / 16 / CONSUMERS; ++i) {
        uint4 v = p[tid + i * CONSUMERS];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
      }
      asm volatile("bar.sync 1, %0;" :: "n"(CONSUMERS) : "memory");
      if (tid == 0) {
        for (uint32_t r = 0; r < CLUSTER; ++r) mbar_arrive_in(&empty[s], r);
      }
    }
    out[blockIdx.x * CONSUMERS + tid] = acc;
  }
  cluster_sync();  // no CTA leaves while its pair may still arrive on or copy into it
}
