// The C ABI's hot path allocates nothing: a host-backend group in this process (as
// hot_path_alloc_test.cc), its endpoints behind C handles, and rounds of layout, dispatch,
// combine, low-latency dispatch and combine through epd/epd.h, each op in a reused holder;
// after warm-up the calling thread's heap allocations (tests/common/counting_new.h, whose
// operators hot_path_alloc_test.cc defines for this binary) must be 0.
#include <dlpack/dlpack.h>
#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "client/c_api/c_api_internal.h"
#include "daemon/dataplane/host/host_data_plane.h"
#include "epd/client.h"
#include "epd/epd.h"
#include "tests/common/counting_new.h"
#include "tests/common/dtypes.h"
#include "tests/common/specs.h"
#include "tests/unit/in_process_ranks.h"

namespace epd {
namespace {

using testing::kBf16;
using testing::kF32;
using testing::kI64;

constexpr int R = 2, E = 8, H = 256, K = 2, M = 16, Mll = 16, T = 12;

/// One rank's inputs and the storage its combine inputs are built in, made once.
struct Rank {
  std::vector<uint16_t> x = std::vector<uint16_t>(T * H);
  std::vector<int64_t> idx = std::vector<int64_t>(T * K);
  std::vector<float> w = std::vector<float>(T * K, 0.5f);
  std::vector<uint16_t> y = std::vector<uint16_t>(R * M * H);  // Normal combine's x.
  std::vector<int64_t> xs{T, H}, ks{T, K};
  std::array<int64_t, 2> ys{0, H};
  DLTensor x_t{}, idx_t{}, w_t{}, y_t{}, ll_region{};
  epd_op_t* op = nullptr;
  epd_handle_t handle{};
};

TEST(CApiHotPathTest, SteadyOpsThroughTheCAbiAllocateNothingOnTheCallingThread) {
  ASSERT_TRUE(testing::counting_new::CountingNewInForce());
  HostDataPlaneOptions o;
  o.op_timeout_ms = 10000;
  o.host_threads = 1;
  auto plane = MakeHostDataPlane(o);
  ASSERT_TRUE(plane.ok()) << plane.status();
  const v1::GroupSpec spec = testing::MakeSpec("c-hot-path", {.num_ranks = R,
                                                              .num_experts = E,
                                                              .hidden = H,
                                                              .num_topk = K,
                                                              .max_tokens_per_rank = M,
                                                              .ll_max_tokens_per_rank = Mll});
  auto group = (*plane)->CreateGroup(spec);
  ASSERT_TRUE(group.ok()) << group.status();
  auto opened = testing::OpenRanks(**group, spec);
  ASSERT_TRUE(opened.ok()) << opened.status();
  std::vector<std::unique_ptr<epd_endpoint>> eps;
  std::vector<Rank> ranks(R);
  for (int r = 0; r < R; ++r) {
    eps.push_back(c_api::MakeEndpointHandle(std::move((*opened)[r])));
    Rank& k = ranks[r];
    for (int i = 0; i < T * H; ++i) k.x[i] = 0x3f80 + (i + r) % 8;  // bf16 values near 1.
    for (int i = 0; i < T * K; ++i) k.idx[i] = (i * 3 + r) % E;
    k.x_t = MakeDLTensor(k.x.data(), kBf16, k.xs);
    k.idx_t = MakeDLTensor(k.idx.data(), kI64, k.ks);
    k.w_t = MakeDLTensor(k.w.data(), kF32, k.ks);
    k.y_t = {k.y.data(), {kDLCPU, 0}, 2, kBf16, k.ys.data(), nullptr, 0};
    ASSERT_EQ(epd_op_create(&k.op), EPD_OK);
    ASSERT_EQ(epd_low_latency_combine_input(eps[r].get(), &k.ll_region), EPD_OK);
  }

  // Submits `submit` on every rank, then waits for each (the host backend's submit does not
  // wait for peers) and hands each rank's held op to `after`.
  auto all = [&](auto submit, auto after) {
    for (int r = 0; r < R; ++r) ASSERT_EQ(submit(r), EPD_OK) << epd_last_error();
    for (int r = 0; r < R; ++r) {
      ASSERT_EQ(epd_op_wait(ranks[r].op, 10000), EPD_OK) << epd_last_error();
      after(r);
    }
  };
  auto round = [&] {
    all(
        [&](int r) {
          epd_layout_args_t a{sizeof(a), &ranks[r].idx_t, nullptr};
          return epd_get_dispatch_layout(eps[r].get(), &a, ranks[r].op);
        },
        [&](int r) {
          epd_layout_result_t res{sizeof(res)};
          ASSERT_EQ(epd_op_layout_result(ranks[r].op, &res), EPD_OK) << epd_last_error();
        });
    all(
        [&](int r) {
          epd_dispatch_args_t a{sizeof(a)};
          a.x = &ranks[r].x_t;
          a.topk_idx = &ranks[r].idx_t;
          a.topk_weights = &ranks[r].w_t;
          return epd_dispatch(eps[r].get(), &a, ranks[r].op);
        },
        [&](int r) {
          epd_dispatch_result_t res{sizeof(res)};
          ASSERT_EQ(epd_op_dispatch_result(ranks[r].op, &res), EPD_OK) << epd_last_error();
          ranks[r].handle = res.handle;
          ranks[r].ys[0] = res.num_recv_tokens;
        });
    all(
        [&](int r) {
          epd_combine_args_t a{sizeof(a)};
          a.x = &ranks[r].y_t;
          a.handle = &ranks[r].handle;
          return epd_combine(eps[r].get(), &a, ranks[r].op);
        },
        [&](int r) {
          epd_combine_result_t res{sizeof(res)};
          ASSERT_EQ(epd_op_combine_result(ranks[r].op, &res), EPD_OK) << epd_last_error();
          ASSERT_EQ(res.combined_x.shape[0], T);
        });
    all(
        [&](int r) {
          epd_ll_dispatch_args_t a{sizeof(a)};
          a.x = &ranks[r].x_t;
          a.topk_idx = &ranks[r].idx_t;
          return epd_low_latency_dispatch(eps[r].get(), &a, ranks[r].op);
        },
        [&](int r) {
          epd_ll_dispatch_result_t res{sizeof(res)};
          ASSERT_EQ(epd_op_ll_dispatch_result(ranks[r].op, &res), EPD_OK) << epd_last_error();
          ranks[r].handle = res.handle;
        });
    all(
        [&](int r) {
          epd_ll_combine_args_t a{sizeof(a)};
          a.x = &ranks[r].ll_region;
          a.topk_idx = &ranks[r].idx_t;
          a.topk_weights = &ranks[r].w_t;
          a.handle = &ranks[r].handle;
          return epd_low_latency_combine(eps[r].get(), &a, ranks[r].op);
        },
        [&](int r) {
          epd_ll_combine_result_t res{sizeof(res)};
          ASSERT_EQ(epd_op_ll_combine_result(ranks[r].op, &res), EPD_OK) << epd_last_error();
          ASSERT_EQ(res.combined_x.shape[0], T);
        });
  };

  for (int i = 0; i < 3; ++i) ASSERT_NO_FATAL_FAILURE(round());
  const uint64_t before = testing::counting_new::t_allocs;
  for (int i = 0; i < 20; ++i) ASSERT_NO_FATAL_FAILURE(round());
  const uint64_t allocs = testing::counting_new::t_allocs - before;
  EXPECT_EQ(allocs, 0u) << "20 rounds of 5 ops on " << R << " ranks through the C ABI";
  for (Rank& k : ranks) epd_op_destroy(k.op);
}

}  // namespace
}  // namespace epd
