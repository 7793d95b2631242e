// Memory-mapped safetensors files and model directories (single file or sharded with an index).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace k3 {

enum class DType { kF32, kBF16, kF16, kI64, kI32, kU8 };

size_t DTypeSize(DType dtype);
const char* DTypeName(DType dtype);  // the safetensors spelling: "F32", "BF16", ...
absl::StatusOr<DType> ParseDType(const std::string& name);

// The file's fp32 element type, named apart from the engine's scalar: tools/fp64_check.sh builds the engine
// with every `float` turned into `double`, and the file's values must still be read as 4-byte floats.
using F32 = float;
inline F32 LoadF32(const std::byte* p) {
  F32 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

struct TensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const std::byte* data = nullptr;  // inside the file mapping
  size_t nbytes = 0;
  std::string file;  // for error messages

  int64_t numel() const;
  std::string ShapeString() const;  // "[4, 128]"
};

// A read-only mmap of one file; unmapped on destruction.
class MappedFile {
 public:
  static absl::StatusOr<std::unique_ptr<MappedFile>> Open(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  MappedFile(std::string path, const std::byte* data, size_t size)
      : path_(std::move(path)), data_(data), size_(size) {}
  std::string path_;
  const std::byte* data_;
  size_t size_;
};

// All tensors of a model directory. Pages are only read when a tensor's bytes are touched, so a
// process that uses a subset (an expert node's shard) reads only that subset.
class Checkpoint {
 public:
  // dir holds model.safetensors, or model.safetensors.index.json naming the shards, or (without an
  // index) any number of *.safetensors files.
  static absl::StatusOr<Checkpoint> Open(const std::string& dir);
  // One file, for tests and tools.
  static absl::StatusOr<Checkpoint> OpenFile(const std::string& path);

  const TensorInfo* Find(const std::string& name) const;
  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  const std::string& dir() const { return dir_; }

 private:
  absl::Status AddFile(const std::string& path);
  std::string dir_;
  std::vector<std::shared_ptr<MappedFile>> files_;
  std::map<std::string, TensorInfo> tensors_;
};

// One tensor to write: raw little-endian bytes of `dtype`.
struct TensorBlob {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::vector<std::byte> bytes;
};

absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorBlob>& tensors);

}  // namespace k3
