// An out-of-tree program built against the installed epd (tests/install/run_consumer.sh):
// it includes <epd/epd.h>, links libepdclient alone, and checks that the library reports
// the version of the package it was found through (EPD_EXPECTED_VERSION, set by the build).
// consumer.cc compiles this same program as C++17.
#include <epd/epd.h>
#include <stdio.h>
#include <string.h>

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
  if (abi != EPD_ABI_VERSION) {
    fprintf(stderr, "consumer (%s): library ABI %d, header ABI %d\n", EPD_CONSUMER_LANG, abi,
            EPD_ABI_VERSION);
    return 1;
  }
  // A call that reaches the client library's gRPC path: no daemon listens on this socket.
  epd_client_options_t options;
  memset(&options, 0, sizeof(options));
  options.struct_size = sizeof(options);
  options.socket_path = "/nonexistent/epd-consumer.sock";
  options.connect_timeout_ms = 500;
  epd_client_t* client = NULL;
  const epd_status_t st = epd_client_connect(&options, &client);
  if (st != EPD_UNAVAILABLE || client != NULL || strstr(epd_last_error(), "epd-consumer") == NULL) {
    fprintf(stderr, "consumer (%s): connect to no daemon gave %s: %s\n", EPD_CONSUMER_LANG,
            epd_status_name(st), epd_last_error());
    return 1;
  }
  printf("consumer (%s): libepdclient %s, C ABI %d; connect without a daemon: %s\n",
         EPD_CONSUMER_LANG, version, abi, epd_status_name(st));
  return 0;
}
