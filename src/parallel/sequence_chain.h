// Context parallelism for the ops that carry something along the sequence (ops/attention_runner.h's
// SequenceChain) under the zigzag split (parallel/ring_attention.h): member r of CP holds chunks r
// and 2 CP - 1 - r as its pieces 0 and 1, so in sequence order the chain runs up the members through
// their first pieces and back down through their second (chunk j's holder: j < CP ? j : 2 CP - 1 - j).
// States cross from one chunk's holder to the next's (member CP - 1 hands its first piece's state to
// its own second); a piece's history is the previous chunk's last tokens, two shifts along the line
// of members. Every message is one send_recv over the cp group, in the same order on every member.
#pragma once
#include "ops/attention_runner.h"

namespace marrow {

class Comm;

// The chain over the cp group (which must outlive it); pieces = 2.
SequenceChain sequence_chain(const Comm& cp);

}  // namespace marrow
