// Checked conversions of Python arguments for epd._C: ints into the C ABI's int32 fields,
// str into C strings, seconds into milliseconds. A value that does not fit raises
// epd.InvalidArgumentError naming the op, the field and the value (pybind11's own casters
// raise a bare TypeError listing the signature instead).
#ifndef EPD_PYTHON_ARGS_H_
#define EPD_PYTHON_ARGS_H_

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

namespace epd_py {

namespace py = pybind11;

/// The type name of `obj` ("int", "numpy.ndarray", ...).
std::string TypeNameOf(py::handle obj);
/// The pending Python exception as "Type: message", cleared.
std::string FetchErrorText();
/// repr(obj), cut to about 80 characters, for messages.
std::string ShortRepr(py::handle obj);

/// `obj` (an int or an object with __index__, e.g. a numpy integer) as an int32.
/// INVALID_ARGUMENT "op: field=VALUE ..." for another type (a float included) or a value
/// outside [-2^31, 2^31).
int32_t ToInt32(py::handle obj, const char* op, const char* field);

/// `obj` (a str) as the UTF-8 bytes of a C string. INVALID_ARGUMENT naming op and field
/// when it is not a str, cannot be encoded (lone surrogates) or holds a NUL, which would end
/// the C string early (the C ABI would see "ab" for "ab\0cd").
std::string ToCString(py::handle obj, const char* op, const char* field);

/// A filesystem path (str, bytes or os.PathLike) as its bytes (str: the filesystem
/// encoding). INVALID_ARGUMENT naming op and field for another type or a NUL in it.
std::string ToPath(py::handle obj, const char* op, const char* field);

/// Timeouts above this many seconds (about 31 years) mean "no limit": the C ABI adds them
/// to a clock in nanoseconds.
inline constexpr double kMaxTimeoutSeconds = 1e9;

/// A timeout in seconds (an int or a float; None: `none_ms`) as milliseconds, rounded;
/// infinity and values above kMaxTimeoutSeconds give `unlimited_ms`. INVALID_ARGUMENT naming
/// op and the value (and what None means: `none_means`) for NaN, a negative value or a
/// non-number.
int64_t TimeoutMs(py::handle obj, const char* op, int64_t none_ms, int64_t unlimited_ms,
                  const char* none_means);

}  // namespace epd_py

#endif  // EPD_PYTHON_ARGS_H_
