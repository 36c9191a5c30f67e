// Driver for the fuzz targets without libFuzzer (g++ builds): feeds random and mutated
// inputs to LLVMFuzzerTestOneInput for --seconds (default 20), printing progress, so
// CI runs every fuzzer for a bounded time. Files named on the command line, and the files
// of directories named there (a seed corpus, tests/fuzz/corpus/<target>/), are replayed
// first (a corpus or a crash reproducer); corpus inputs are also mutated during the run.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int main(int argc, char** argv) {
  double seconds = 20;
  uint64_t seed = 1;
  std::vector<std::string> files;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--seconds=", 10) == 0) {
      seconds = std::atof(argv[i] + 10);
    } else if (std::strncmp(argv[i], "--seed=", 7) == 0) {
      seed = std::strtoull(argv[i] + 7, nullptr, 10);
    } else {
      files.emplace_back(argv[i]);
    }
  }
  std::vector<std::vector<uint8_t>> corpus;
  auto replay = [&](const std::filesystem::path& path) {
    std::ifstream in(path, std::ios::binary);
    corpus.emplace_back((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    LLVMFuzzerTestOneInput(corpus.back().data(), corpus.back().size());
  };
  for (const std::string& f : files) {
    std::error_code ec;
    if (std::filesystem::is_directory(f, ec)) {
      for (const auto& entry : std::filesystem::directory_iterator(f, ec)) {
        if (entry.is_regular_file()) replay(entry.path());
      }
    } else {
      replay(f);
    }
  }
  std::printf("fuzz: replayed %zu input(s)\n", corpus.size());
  std::mt19937_64 rng(seed);
  auto start = std::chrono::steady_clock::now();
  auto last_report = start;
  uint64_t runs = 0;
  std::vector<uint8_t> buf;
  while (true) {
    auto now = std::chrono::steady_clock::now();
    double elapsed = std::chrono::duration<double>(now - start).count();
    if (elapsed >= seconds) break;
    if (now - last_report > std::chrono::seconds(5)) {
      std::printf("fuzz: %llu runs, %.0f s\n", static_cast<unsigned long long>(runs), elapsed);
      std::fflush(stdout);
      last_report = now;
    }
    if (!corpus.empty() && runs % 2 == 0) {
      // A corpus input with a few bytes flipped, inserted or cut.
      buf = corpus[rng() % corpus.size()];
      for (int edits = 1 + static_cast<int>(rng() % 4); edits > 0; --edits) {
        const size_t at = buf.empty() ? 0 : rng() % buf.size();
        switch (rng() % 3) {
          case 0:
            if (!buf.empty()) buf[at] ^= static_cast<uint8_t>(1u << (rng() % 8));
            break;
          case 1:
            buf.insert(buf.begin() + static_cast<std::ptrdiff_t>(at), static_cast<uint8_t>(rng()));
            break;
          default:
            if (!buf.empty()) buf.resize(at);
            break;
        }
      }
    } else {
      size_t size = rng() % 4096;
      buf.resize(size);
      for (auto& b : buf) b = static_cast<uint8_t>(rng());
      // Bias some inputs towards small values, which reach deeper code.
      if (runs % 3 == 0)
        for (auto& b : buf) b &= 0x0f;
    }
    LLVMFuzzerTestOneInput(buf.data(), buf.size());
    ++runs;
  }
  std::printf("fuzz: done, %llu runs in %.0f s, no crash\n", static_cast<unsigned long long>(runs),
              seconds);
  return 0;
}
