// What a resumed (or continued) run may change against the run that wrote its checkpoint.
//
// A change of the data order or of the weights' meaning is refused unless checkpoint.allow_changes
// names its kind, and every allowed change is recorded in later checkpoints (meta.json
// "config_changes"):
//   data       train.seed, train.global_batch, train.seq_len, data.validation_fraction, the corpus's tokens
//   tokenizer  another tokenizer than the checkpoint's (token ids would mean other strings)
// Everything else (learning rate, steps, batch split, parallel layout, ...) may change freely.
// Refused without checkpoint.allow_changes=data|tokenizer: a change of train.seed, global_batch,
// seq_len, data.validation_fraction, the corpus or its tokenizer. Anything else may change, so tests
// that resume with another layout may change the layout freely.
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
