// `epctl explain` (explain.h).
#include "client/epctl/explain.h"

#include <cstdint>
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/epctl/format.h"

namespace epd::epctl {
namespace {

std::string JsonString(absl::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out += absl::StrFormat("\\u%04x", static_cast<unsigned char>(c));
        } else {
          out += c;  // UTF-8 passes through.
        }
    }
  }
  return out + "\"";
}

std::string ReasonObject(const errors::ReasonInfo& r, absl::string_view indent) {
  return absl::StrCat(indent, "{\n", indent,
                      "  \"code\": ", JsonString(errors::ReasonCode(r.reason)), ",\n", indent,
                      "  \"number\": ", static_cast<int32_t>(r.reason), ",\n", indent,
                      "  \"name\": ", JsonString(r.name), ",\n", indent,
                      "  \"status\": ", JsonString(absl::StatusCodeToString(r.code)), ",\n", indent,
                      "  \"cause\": ", JsonString(r.cause), ",\n", indent,
                      "  \"next_step\": ", JsonString(r.next_step), "\n", indent, "}");
}

}  // namespace

std::string FormatReason(const errors::ReasonInfo& r) {
  return absl::StrCat(errors::ReasonCode(r.reason), " ", r.name, " (",
                      absl::StatusCodeToString(r.code), ")\n  cause:     ", r.cause,
                      "\n  next step: ", r.next_step, "\n");
}

std::string FormatReasonList() {
  Table table({"CODE", "NAME", "STATUS"});
  for (const errors::ReasonInfo& r : errors::AllReasons()) {
    table.AddRow(
        {errors::ReasonCode(r.reason), std::string(r.name), absl::StatusCodeToString(r.code)});
  }
  return table.Render();
}

std::string ReasonJson(const errors::ReasonInfo& r) { return ReasonObject(r, "") + "\n"; }

std::string ReasonListJson() {
  std::string out = "{\n  \"reasons\": [\n";
  bool first = true;
  for (const errors::ReasonInfo& r : errors::AllReasons()) {
    absl::StrAppend(&out, first ? "" : ",\n", ReasonObject(r, "    "));
    first = false;
  }
  return out + "\n  ]\n}\n";
}

int RunExplain(absl::string_view arg, bool list, bool json) {
  std::string text;
  if (list) {
    text = json ? ReasonListJson() : FormatReasonList();
  } else {
    const errors::ReasonInfo* r = errors::LookupReason(arg);
    if (r == nullptr) {
      std::fprintf(stderr,
                   "epctl: \"%s\" is no reason of the error catalog (EPD-2003, 2003 or "
                   "CUDA_DRIVER_TOO_OLD; `epctl explain --list` lists them)\n",
                   std::string(arg).c_str());
      return 1;
    }
    text = json ? ReasonJson(*r) : FormatReason(*r);
  }
  std::fwrite(text.data(), 1, text.size(), stdout);
  return 0;
}

}  // namespace epd::epctl
