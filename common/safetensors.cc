#include "common/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "absl/strings/str_join.h"

namespace k3 {
namespace {

using json = nlohmann::json;

struct DTypeRow {
  DType dtype;
  const char* name;
  size_t size;
};
constexpr DTypeRow kDTypes[] = {
    {DType::kF32, "F32", 4}, {DType::kBF16, "BF16", 2}, {DType::kF16, "F16", 2},
    {DType::kI64, "I64", 8}, {DType::kI32, "I32", 4},   {DType::kU8, "U8", 1},
};

// Header size above this is certainly a corrupt file (the format caps it at 100 MB).
constexpr uint64_t kMaxHeader = 100u << 20;

}  // namespace

size_t DTypeSize(DType dtype) {
  for (const auto& r : kDTypes)
    if (r.dtype == dtype) return r.size;
  return 0;
}

const char* DTypeName(DType dtype) {
  for (const auto& r : kDTypes)
    if (r.dtype == dtype) return r.name;
  return "?";
}

absl::StatusOr<DType> ParseDType(const std::string& name) {
  for (const auto& r : kDTypes)
    if (name == r.name) return r.dtype;
  return absl::InvalidArgumentError(absl::StrCat("unsupported dtype \"", name, "\""));
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorInfo::ShapeString() const { return absl::StrCat("[", absl::StrJoin(shape, ", "), "]"); }

absl::StatusOr<std::unique_ptr<MappedFile>> MappedFile::Open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::NotFoundError(absl::StrCat(path, ": ", std::strerror(errno)));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    return absl::InternalError(absl::StrCat(path, ": fstat: ", std::strerror(e)));
  }
  size_t size = static_cast<size_t>(st.st_size);
  const std::byte* data = nullptr;
  if (size > 0) {
    void* p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      int e = errno;
      ::close(fd);
      return absl::InternalError(absl::StrCat(path, ": mmap: ", std::strerror(e)));
    }
    data = static_cast<const std::byte*>(p);
  }
  ::close(fd);  // the mapping keeps the file alive
  return std::unique_ptr<MappedFile>(new MappedFile(path, data, size));
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<std::byte*>(data_), size_);
}

absl::StatusOr<Checkpoint> Checkpoint::OpenFile(const std::string& path) {
  Checkpoint ckpt;
  ckpt.dir_ = std::filesystem::path(path).parent_path().string();
  K3_RETURN_IF_ERROR(ckpt.AddFile(path));
  return ckpt;
}

absl::StatusOr<Checkpoint> Checkpoint::Open(const std::string& dir) {
  namespace fs = std::filesystem;
  Checkpoint ckpt;
  ckpt.dir_ = dir;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return absl::NotFoundError(absl::StrCat(dir, ": not a directory"));

  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  std::vector<std::string> files;
  if (fs::exists(index)) {
    std::ifstream in(index);
    json j = json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      return absl::InvalidArgumentError(
          absl::StrCat(index.string(), ": not valid JSON with a \"weight_map\" object"));
    std::map<std::string, std::string> expected;  // tensor -> shard, checked after loading
    for (auto& [name, file] : j["weight_map"].items()) {
      if (!file.is_string())
        return absl::InvalidArgumentError(absl::StrCat(index.string(), ": weight_map[\"", name, "\"] is not a string"));
      expected[name] = file.get<std::string>();
      if (std::find(files.begin(), files.end(), file.get<std::string>()) == files.end())
        files.push_back(file.get<std::string>());
    }
    for (const auto& f : files) K3_RETURN_IF_ERROR(ckpt.AddFile((fs::path(dir) / f).string()));
    for (const auto& [name, file] : expected) {
      const TensorInfo* t = ckpt.Find(name);
      if (t == nullptr || fs::path(t->file).filename() != file)
        return absl::NotFoundError(absl::StrCat(index.string(), ": tensor \"", name, "\" is listed in ", file,
                                                " but not stored there"));
    }
    return ckpt;
  }
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (e.is_regular_file() && name.size() > 12 && name.ends_with(".safetensors") && name != "golden.safetensors")
      files.push_back(e.path().string());
  }
  if (files.empty()) return absl::NotFoundError(absl::StrCat(dir, ": no *.safetensors file"));
  std::sort(files.begin(), files.end());
  for (const auto& f : files) K3_RETURN_IF_ERROR(ckpt.AddFile(f));
  return ckpt;
}

absl::Status Checkpoint::AddFile(const std::string& path) {
  K3_ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> file, MappedFile::Open(path));
  const size_t size = file->size();
  if (size < 8) return absl::DataLossError(absl::StrCat(path, ": truncated (", size, " bytes, no header)"));
  uint64_t header_len = 0;
  std::memcpy(&header_len, file->data(), 8);
  if (header_len > kMaxHeader || header_len > size - 8)
    return absl::DataLossError(absl::StrCat(path, ": truncated or corrupt: header of ", header_len,
                                            " bytes in a file of ", size));
  const char* hbegin = reinterpret_cast<const char*>(file->data()) + 8;
  json header = json::parse(hbegin, hbegin + header_len, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object())
    return absl::DataLossError(absl::StrCat(path, ": header is not a JSON object"));

  const std::byte* base = file->data() + 8 + header_len;
  const size_t data_size = size - 8 - header_len;
  for (auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    auto bad = [&](const std::string& why) {
      return absl::DataLossError(absl::StrCat(path, ": tensor \"", name, "\": ", why));
    };
    if (!entry.is_object() || !entry.contains("dtype") || !entry.contains("shape") ||
        !entry.contains("data_offsets"))
      return bad("entry needs dtype, shape and data_offsets");
    if (!entry["dtype"].is_string()) return bad("dtype is not a string");
    auto dtype = ParseDType(entry["dtype"].get<std::string>());
    if (!dtype.ok()) return bad(std::string(dtype.status().message()));
    TensorInfo t;
    t.name = name;
    t.dtype = *dtype;
    t.file = path;
    if (!entry["shape"].is_array()) return bad("shape is not an array");
    for (auto& d : entry["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) return bad("shape has a negative or non-integer dim");
      t.shape.push_back(d.get<int64_t>());
    }
    auto& off = entry["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      return bad("data_offsets must be two non-negative integers");
    const uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
    if (begin > end) return bad("data_offsets are reversed");
    if (end > data_size)
      return bad(absl::StrCat("data ends at byte ", end, " but the file holds ", data_size,
                              " data bytes (truncated file)"));
    t.nbytes = end - begin;
    if (t.nbytes != static_cast<uint64_t>(t.numel()) * DTypeSize(t.dtype))
      return bad(absl::StrCat(t.nbytes, " bytes do not match shape ", t.ShapeString(), " of ", DTypeName(t.dtype)));
    t.data = base + begin;
    if (tensors_.count(name)) return bad("stored twice (also in " + tensors_[name].file + ")");
    tensors_.emplace(name, std::move(t));
  }
  files_.push_back(std::move(file));
  return absl::OkStatus();
}

const TensorInfo* Checkpoint::Find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorBlob>& tensors) {
  json header = json::object();
  header["__metadata__"] = {{"format", "pt"}};
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    if (t.bytes.size() != static_cast<size_t>(numel) * DTypeSize(t.dtype))
      return absl::InvalidArgumentError(absl::StrCat("tensor \"", t.name, "\": byte count does not match its shape"));
    header[t.name] = {{"dtype", DTypeName(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');  // keep tensor data 8-byte aligned
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::PermissionDeniedError(absl::StrCat(path, ": cannot open for writing"));
  const uint64_t n = h.size();
  out.write(reinterpret_cast<const char*>(&n), 8);
  out.write(h.data(), static_cast<std::streamsize>(h.size()));
  for (const auto& t : tensors) out.write(reinterpret_cast<const char*>(t.bytes.data()), static_cast<std::streamsize>(t.bytes.size()));
  out.close();
  if (!out) return absl::DataLossError(absl::StrCat(path, ": write failed"));
  return absl::OkStatus();
}

}  // namespace k3
