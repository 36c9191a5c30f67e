// The C ABI's version queries, epd_version_string() and epd_abi_version(), exported from
// libepdclient.so (client/epdclient.map); their declarations are in epd/epd.h.
#include "common/version.h"

#if __has_include("epd/epd.h")
#include "epd/epd.h"
#else
#define EPD_API __attribute__((visibility("default")))
#endif

extern "C" {

/// epd's release, "MAJOR.MINOR.PATCH" (the project's version); static storage, never null.
EPD_API const char* epd_version_string(void) { return epd::kEpdVersion; }

/// The C ABI's version: changes, with libepdclient's SONAME, when the ABI breaks.
EPD_API int epd_abi_version(void) { return 1; }

}  // extern "C"
