#include "args.h"

#include <climits>
#include <cmath>
#include <cstring>

#include "dlpack_io.h"

namespace epd_py {

std::string TypeNameOf(py::handle obj) { return Py_TYPE(obj.ptr())->tp_name; }

std::string FetchErrorText() {
  py::error_already_set e;
  return e.what();
}

std::string ShortRepr(py::handle obj) {
  PyObject* r = PyObject_Repr(obj.ptr());
  if (r == nullptr) {
    PyErr_Clear();
    return "<" + TypeNameOf(obj) + " object>";
  }
  std::string text = py::reinterpret_steal<py::str>(r);
  constexpr size_t kMax = 80;
  if (text.size() > kMax) text = text.substr(0, kMax) + "...";
  return text;
}

namespace {

[[noreturn]] void RaiseField(const char* op, const char* field, py::handle obj,
                             const std::string& why) {
  RaiseStatus(EPD_INVALID_ARGUMENT,
              std::string(op) + ": " + field + "=" + ShortRepr(obj) + " " + why);
}

}  // namespace

int32_t ToInt32(py::handle obj, const char* op, const char* field) {
  PyObject* o = obj.ptr();
  py::object index;
  if (!PyLong_Check(o)) {
    if (PyFloat_Check(o) || !PyIndex_Check(o)) {
      RaiseField(op, field, obj, "is a " + TypeNameOf(obj) + ", expected an int");
    }
    index = py::reinterpret_steal<py::object>(PyNumber_Index(o));
    if (!index) RaiseField(op, field, obj, "is not an integer: " + FetchErrorText());
    o = index.ptr();
  }
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (v == -1 && PyErr_Occurred()) RaiseField(op, field, obj, FetchErrorText());
  if (overflow != 0 || v < INT32_MIN || v > INT32_MAX) {
    RaiseField(op, field, obj, "is outside the int32 range [-2147483648, 2147483647]");
  }
  return static_cast<int32_t>(v);
}

namespace {

std::string CheckNoNul(std::string bytes, const char* op, const char* field, py::handle obj) {
  const size_t nul = bytes.find('\0');
  if (nul != std::string::npos) {
    RaiseField(op, field, obj,
               "holds a NUL character (at byte " + std::to_string(nul) +
                   "), which would end the C string there");
  }
  return bytes;
}

}  // namespace

std::string ToCString(py::handle obj, const char* op, const char* field) {
  if (!PyUnicode_Check(obj.ptr())) {
    RaiseField(op, field, obj, "is a " + TypeNameOf(obj) + ", expected a str");
  }
  Py_ssize_t size = 0;
  const char* utf8 = PyUnicode_AsUTF8AndSize(obj.ptr(), &size);
  if (utf8 == nullptr) RaiseField(op, field, obj, "is not valid UTF-8: " + FetchErrorText());
  return CheckNoNul(std::string(utf8, static_cast<size_t>(size)), op, field, obj);
}

std::string ToPath(py::handle obj, const char* op, const char* field) {
  py::object path = py::reinterpret_steal<py::object>(PyOS_FSPath(obj.ptr()));
  if (!path) {
    PyErr_Clear();
    RaiseField(op, field, obj,
               "is a " + TypeNameOf(obj) + ", expected a str, bytes or os.PathLike");
  }
  py::object bytes = path;
  if (PyUnicode_Check(path.ptr())) {
    bytes = py::reinterpret_steal<py::object>(PyUnicode_EncodeFSDefault(path.ptr()));
    if (!bytes) RaiseField(op, field, obj, "cannot be encoded: " + FetchErrorText());
  }
  char* data = nullptr;
  Py_ssize_t size = 0;
  if (PyBytes_AsStringAndSize(bytes.ptr(), &data, &size) != 0) {
    RaiseField(op, field, obj, FetchErrorText());
  }
  return CheckNoNul(std::string(data, static_cast<size_t>(size)), op, field, obj);
}

int64_t TimeoutMs(py::handle obj, const char* op, int64_t none_ms, int64_t unlimited_ms,
                  const char* none_means) {
  if (obj.is_none()) return none_ms;
  auto fail = [&](const std::string& why) {
    RaiseField(op, "timeout", obj, why + " (None: " + none_means + ")");
  };
  PyObject* o = obj.ptr();
  if (!PyFloat_Check(o) && !PyLong_Check(o) && !PyIndex_Check(o)) {
    fail("is a " + TypeNameOf(obj) + ", expected seconds (a number) or None");
  }
  const double seconds = PyFloat_AsDouble(o);
  if (seconds == -1.0 && PyErr_Occurred()) {  // an int beyond a double
    PyErr_Clear();
    if (PyObject_RichCompareBool(o, py::int_(0).ptr(), Py_LT) == 1) fail("is negative");
    PyErr_Clear();
    return unlimited_ms;
  }
  if (std::isnan(seconds)) fail("is not a number of seconds");
  if (seconds < 0) fail("is negative");
  if (seconds > kMaxTimeoutSeconds) return unlimited_ms;  // infinity included
  return static_cast<int64_t>(std::llround(seconds * 1000.0));
}

}  // namespace epd_py
