// The portable kernel sources (csrc/kernels/), embedded at build time by
// cmake/embed_sources.cmake so the runtime compiler can read them without the source tree.
#pragma once

namespace jaxfuse {

struct EmbeddedSource {
  const char* name;
  const char* text;
};

extern const EmbeddedSource kEmbeddedSources[];
extern const int kNumEmbeddedSources;

}  // namespace jaxfuse
