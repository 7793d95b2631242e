// A kernel timeline where nsys is missing (the device machine): a CUPTI library the CUDA driver loads at start-up
// (CUDA_INJECTION64_PATH=…/libk3serve-cupti-trace.so) that records every kernel's, memset's and copy's start, end,
// stream and name, graph nodes included, and writes them as CSV to $TRACE_OUT at exit. tools/cupti_trace/steps.py
// turns a trace of k3serve-bench-e2e into what each kernel adds to a decode step (docs/performance-log.md, 215f4ae).
#include <cupti.h>
#include <cxxabi.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace {
std::mutex mu;
std::vector<std::string> lines;

void CUPTIAPI Requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *size = 8 << 20;
  *buffer = static_cast<uint8_t*>(aligned_alloc(8, *size));
  *max_records = 0;
}

void CUPTIAPI Completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* r = nullptr;
  std::lock_guard<std::mutex> lock(mu);
  while (cuptiActivityGetNextRecord(buffer, valid, &r) == CUPTI_SUCCESS) {
    unsigned long long start = 0, end = 0;
    uint32_t stream = 0;
    std::string name;
    if (r->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || r->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(r);
      int status = 0;
      char* dem = abi::__cxa_demangle(k->name, nullptr, nullptr, &status);
      name = status == 0 && dem ? dem : k->name;
      free(dem);
      start = k->start, end = k->end, stream = k->streamId;
    } else if (r->kind == CUPTI_ACTIVITY_KIND_MEMSET) {  // graph memset nodes too (cuBLASLt's, say)
      const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(r);
      name = "memset " + std::to_string(m->bytes) + " bytes";
      start = m->start, end = m->end, stream = m->streamId;
    } else if (r->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(r);
      name = "memcpy " + std::to_string(m->bytes) + " bytes";
      start = m->start, end = m->end, stream = m->streamId;
    } else {
      continue;
    }
    for (char& c : name)
      if (c == ',') c = ';';
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%llu,%llu,%u,", start, end, stream);
    lines.push_back(buf + name);
  }
  free(buffer);
}

void Flush() {
  cuptiActivityFlushAll(1);
  const char* path = std::getenv("TRACE_OUT");
  FILE* f = std::fopen(path ? path : "trace.csv", "w");
  if (!f) return;
  std::fprintf(f, "start,end,stream,name\n");
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& l : lines) std::fprintf(f, "%s\n", l.c_str());
  std::fclose(f);
}
}  // namespace

extern "C" int InitializeInjection(void) {
  cuptiActivityRegisterCallbacks(Requested, Completed);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY);
  std::atexit(Flush);
  return 1;
}
