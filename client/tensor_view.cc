// TensorView: DLTensor views into endpoint buffers (no heap allocation for <= 4 dimensions).
#include <utility>

#include "epd/client.h"

namespace epd {

TensorView::TensorView(void* data, DLDataType dtype, DLDevice device, TensorShape shape)
    : shape_(std::move(shape)) {
  tensor_.data = data;
  tensor_.dtype = dtype;
  tensor_.device = device;
  tensor_.strides = nullptr;
  tensor_.byte_offset = 0;
  Rebind();
}

TensorView::TensorView(void* data, DLDataType dtype, DLDevice device, TensorShape shape,
                       TensorShape strides)
    : TensorView(data, dtype, device, std::move(shape)) {
  strides_ = std::move(strides);
  Rebind();
}

TensorView::TensorView(const TensorView& other)
    : shape_(other.shape_), strides_(other.strides_), tensor_(other.tensor_) {
  Rebind();
}

TensorView& TensorView::operator=(const TensorView& other) {
  if (this != &other) {
    shape_ = other.shape_;
    strides_ = other.strides_;
    tensor_ = other.tensor_;
    Rebind();
  }
  return *this;
}

void TensorView::Rebind() {
  tensor_.ndim = static_cast<int32_t>(shape_.size());
  tensor_.shape = shape_.empty() ? nullptr : shape_.mutable_data();
  tensor_.strides = strides_.empty() ? nullptr : strides_.mutable_data();
}

int64_t TensorView::numel() const {
  if (tensor_.data == nullptr && shape_.empty()) return 0;
  int64_t n = 1;
  for (int64_t d : shape_) n *= d;
  return n;
}

int64_t TensorView::nbytes() const {
  return numel() * ((tensor_.dtype.bits * tensor_.dtype.lanes + 7) / 8);
}

}  // namespace epd
