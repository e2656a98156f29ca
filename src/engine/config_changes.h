// What a resumed (or continued) run may change against the run that wrote its checkpoint.
//
// One rule: a change that alters the data order or the meaning of the weights is refused unless
// the run config names its kind in checkpoint.allow_changes (comma-separated), and every allowed
// change is recorded in the checkpoints the run writes afterwards (meta.json "config_changes").
//   data       the sample order: train.seed, train.global_batch, train.seq_len,
//              data.validation_fraction, or the corpus's tokens themselves
//   tokenizer  the corpus was made with another tokenizer than the checkpoint's (token ids mean
//              other strings: the embeddings and the LM head no longer fit the text)
// Everything else (learning rate, steps, batch split, parallel layout, ...) may change freely.
#pragma once
#include <string>
#include <vector>

#include "core/json.h"
#include "data/token_corpus.h"
#include "engine/run_config.h"

namespace marrow {

// The kinds checkpoint.allow_changes accepts.
inline const std::vector<std::string> kChangeKinds = {"data", "tokenizer"};

// A fingerprint of a corpus's tokens: the sha256 of its shards' sha256s in order.
std::string corpus_fingerprint(const CorpusManifest& corpus);

// Compares the checkpoint's meta.json with this run; fails with one sentence naming the first
// change whose kind is not allowed. Returns meta's "config_changes" list plus, when anything
// changed, an entry {"at_step", "allowed", "changes"} for this resume.
Json check_config_changes(const Json& meta, const RunConfig& rc, const CorpusManifest& corpus);

}  // namespace marrow
