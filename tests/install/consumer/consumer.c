// An out-of-tree program built against the installed epd (tests/install/run_consumer.sh):
// it includes <epd/epd.h>, links libepdclient alone, and checks that the library reports
// the version of the package it was found through (EPD_EXPECTED_VERSION, set by the build).
// consumer.cc compiles this same program as C++17.
#include <stdio.h>
#include <string.h>

#if __has_include(<epd/epd.h>)
#include <epd/epd.h>
#define EPD_CONSUMER_HEADER "<epd/epd.h>"
#else
// Until <epd/epd.h> is installed: the two functions the C ABI will declare.
#ifdef __cplusplus
extern "C" {
#endif
const char* epd_version_string(void);
int epd_abi_version(void);
#ifdef __cplusplus
}
#endif
#define EPD_CONSUMER_HEADER "own declarations"
#endif

#ifndef EPD_EXPECTED_VERSION
#error "build with -DEPD_EXPECTED_VERSION=\"MAJOR.MINOR.PATCH\" (the package's version)"
#endif

#ifdef __cplusplus
#define EPD_CONSUMER_LANG "C++"
#else
#define EPD_CONSUMER_LANG "C"
#endif

int main(void) {
  const char* version = epd_version_string();
  int abi = epd_abi_version();
  if (version == NULL || strcmp(version, EPD_EXPECTED_VERSION) != 0) {
    fprintf(stderr, "consumer (%s): epd_version_string() is '%s', the package is '%s'\n",
            EPD_CONSUMER_LANG, version ? version : "(null)", EPD_EXPECTED_VERSION);
    return 1;
  }
  if (abi < 1) {
    fprintf(stderr, "consumer (%s): epd_abi_version() is %d, expected >= 1\n", EPD_CONSUMER_LANG,
            abi);
    return 1;
  }
#ifdef EPD_ABI_VERSION
  if (abi != EPD_ABI_VERSION) {
    fprintf(stderr, "consumer (%s): library ABI %d, header ABI %d\n", EPD_CONSUMER_LANG, abi,
            EPD_ABI_VERSION);
    return 1;
  }
#endif
  printf("consumer (%s): libepdclient %s, C ABI %d, declared by %s\n", EPD_CONSUMER_LANG, version,
         abi, EPD_CONSUMER_HEADER);
  return 0;
}
