#pragma once
// The 64-bit mixer every deterministic choice of eplb is built on (the finalizer of
// splitmix64): replica choice by token (routing), and everything the emulator derives from
// (layer, expert, step, token). One definition, so a device kernel or another language can
// restate it once and match bit for bit.

#include <cstdint>

namespace eplb {

constexpr uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}

}  // namespace eplb
