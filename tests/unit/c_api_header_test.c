/* epd/epd.h compiled as C11 (-std=c11 -Wpedantic -Werror) and linked against libepdclient:
 * the header is valid C, its structs have the sizes the ABI fixes, and the calls that need no
 * daemon answer as documented (versions, status names, NULL and struct_size refusals naming
 * the argument, UNAVAILABLE for a socket nobody serves). CTest c_api.header_c11. */
#include <stdio.h>
#include <string.h>

#include "epd/epd.h"

_Static_assert(sizeof(epd_status_t) == sizeof(int), "epd_status_t is an int-sized enum");
_Static_assert(sizeof(epd_handle_t) == 48, "epd_handle_t is 48 bytes");
_Static_assert(offsetof(epd_dispatch_args_t, struct_size) == 0, "struct_size comes first");
_Static_assert(offsetof(epd_ll_dispatch_result_t, struct_size) == 0, "struct_size comes first");
#if defined(__LP64__)
/* Fields appended after the first version start where that version's struct ended (its
 * sizeof, tail padding included), so a first-version struct_size never covers them. */
_Static_assert(offsetof(epd_ll_dispatch_args_t, use_ue8m0) == 56,
               "use_ue8m0 starts at the first version's sizeof(epd_ll_dispatch_args_t)");
_Static_assert(offsetof(epd_program_step_t, use_ue8m0) == 24,
               "use_ue8m0 starts at the first version's sizeof(epd_program_step_t)");
_Static_assert(offsetof(epd_join_options_t, nodes) == 80,
               "nodes starts at the first version's sizeof(epd_join_options_t)");
_Static_assert(offsetof(epd_join_options_t, transport) == 96,
               "transport follows num_nodes (and its padding)");
_Static_assert(offsetof(epd_join_options_t, on_rank_failure) == 104,
               "on_rank_failure follows transport");
_Static_assert(offsetof(epd_ll_dispatch_result_t, mask) + sizeof(epd_op_mask_t) ==
                   sizeof(epd_ll_dispatch_result_t),
               "mask ends the struct");
_Static_assert(sizeof(epd_op_mask_t) == 16, "epd_op_mask_t is four 32-bit words");
_Static_assert(sizeof(epd_node_t) == 16, "epd_node_t is a pointer and an int32 (padded)");
#endif
_Static_assert(EPD_INVALID_ARGUMENT == 3 && EPD_FAILED_PRECONDITION == 9 && EPD_UNAVAILABLE == 14,
               "status codes are absl::StatusCode numbers");

static int failures = 0;

static void Check(int ok, const char* what) {
  if (!ok) {
    fprintf(stderr, "FAIL: %s (last error: %s)\n", what, epd_last_error());
    ++failures;
  }
}

int main(void) {
  Check(epd_abi_version() == EPD_ABI_VERSION, "epd_abi_version() == EPD_ABI_VERSION");
  Check(strlen(epd_version_string()) > 0, "epd_version_string() is not empty");
  Check(strcmp(epd_status_name(EPD_INVALID_ARGUMENT), "INVALID_ARGUMENT") == 0,
        "epd_status_name(EPD_INVALID_ARGUMENT)");
  Check(strcmp(epd_status_name(99), "UNKNOWN_CODE") == 0, "epd_status_name(99)");

  /* NULL out-parameter: refused, naming it. */
  Check(epd_client_connect(NULL, NULL) == EPD_INVALID_ARGUMENT, "connect(NULL, NULL)");
  Check(strstr(epd_last_error(), "out is NULL") != NULL, "the message names out");

  /* struct_size too small: refused, naming the struct. */
  epd_client_t* client = NULL;
  epd_client_options_t options;
  memset(&options, 0, sizeof(options));
  options.struct_size = sizeof(size_t);
  Check(epd_client_connect(&options, &client) == EPD_INVALID_ARGUMENT, "connect, struct_size 8");
  Check(strstr(epd_last_error(), "epd_client_options_t.struct_size=8") != NULL,
        "the message names epd_client_options_t.struct_size");
  Check(client == NULL, "no client on failure");

  /* Nobody serves the socket: UNAVAILABLE naming it. */
  options.struct_size = sizeof(options);
  options.socket_path = "/nonexistent/epd-c-header-test.sock";
  options.connect_timeout_ms = 200;
  Check(epd_client_connect(&options, &client) == EPD_UNAVAILABLE, "connect to no daemon");
  Check(strstr(epd_last_error(), "epd-c-header-test.sock") != NULL, "the message names the socket");

  /* The Peer address of no client: refused, naming it; a node list in the join options. */
  char address[64];
  Check(epd_client_peer_address(NULL, address, sizeof(address), NULL) == EPD_INVALID_ARGUMENT,
        "peer_address(NULL client)");
  Check(strstr(epd_last_error(), "client is NULL") != NULL, "the message names client");
  epd_node_t nodes[2] = {{"10.0.0.1:7300", 2}, {"10.0.0.2:7300", 2}};
  epd_join_options_t join;
  memset(&join, 0, sizeof(join));
  join.struct_size = sizeof(join);
  join.nodes = nodes;
  join.num_nodes = 2;
  epd_endpoint_t* endpoint = NULL;
  Check(epd_client_join(NULL, &join, &endpoint) == EPD_INVALID_ARGUMENT, "join(NULL client)");

  /* Reconnect and rank masks of no client / endpoint: refused, naming them. */
  Check(epd_client_reconnect(NULL, 100) == EPD_INVALID_ARGUMENT, "reconnect(NULL client)");
  Check(strstr(epd_last_error(), "client is NULL") != NULL, "the message names client");
  epd_rank_mask_t mask;
  memset(&mask, 0, sizeof(mask));
  mask.struct_size = sizeof(mask);
  join.on_rank_failure = EPD_RANK_FAILURE_MASK;
  Check(epd_endpoint_query_rank_mask(NULL, &mask) == EPD_INVALID_ARGUMENT, "query_rank_mask(NULL)");
  Check(strstr(epd_last_error(), "endpoint is NULL") != NULL, "the message names endpoint");

  /* An empty op holder. */
  epd_op_t* op = NULL;
  Check(epd_op_create(&op) == EPD_OK && op != NULL, "epd_op_create");
  Check(epd_last_error()[0] == '\0', "the last error is cleared by a success");
  Check(epd_op_kind(op) == EPD_OP_NONE, "an empty op has kind NONE");
  Check(epd_op_wait(op, 0) == EPD_FAILED_PRECONDITION, "wait of an empty op");
  epd_layout_result_t layout;
  memset(&layout, 0, sizeof(layout));
  layout.struct_size = sizeof(layout);
  Check(epd_op_layout_result(op, &layout) == EPD_FAILED_PRECONDITION, "result of an empty op");
  epd_op_destroy(op);
  epd_op_destroy(NULL);
  epd_client_destroy(NULL);
  epd_endpoint_destroy(NULL);

  if (failures == 0)
    printf("c_api_header_test: ok (epd %s, ABI %d)\n", epd_version_string(), epd_abi_version());
  return failures == 0 ? 0 : 1;
}
