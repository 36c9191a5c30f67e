// consumer.c compiled as C++17: <epd/epd.h> must serve C++ callers too (C linkage, no C++20,
// no gRPC, protobuf or abseil headers). tests/install/run_consumer.sh builds and runs it.
#include "consumer.c"
