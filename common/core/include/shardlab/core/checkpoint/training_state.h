#pragma once
/// @file training_state.h
/// A training run's state as checkpoints hold it: the model's named parameters and buffers (as a wrapper holds
/// them: replicated, or sharded by rows), and the optimizer's state for each parameter, laid out like it. What
/// every wrapper's save_checkpoint / load_checkpoint is made of (checkpoint.h does the files).
///
/// Names: a model tensor keeps its full model name ("block0.fc.weight"), as in PyTorch's state_dict; the
/// optimizer's state of it is "optim.<name>.<field>" (fields as PyTorch names them: momentum_buffer for SGD;
/// exp_avg, exp_avg_sq and max_exp_avg_sq for Adam and AdamW), its step count the metadata "optim.<name>.step",
/// and the optimizer's kind the metadata "optim.kind" ("sgd", "adam", "adamw"). See Note [Optimizer state by name].

#include "shardlab/core/checkpoint/checkpoint.h"
#include "shardlab/core/comm/communicator.h"
#include "shardlab/core/model/model.h"

#include <torch/optim/optimizer.h>

#include <map>
#include <string>

namespace shardlab {

/// The model's parameters and buffers as a replica holds them (every rank all of it; rank 0 saves): full names,
/// registration order, a tensor registered under two names (a tied weight) once, under its first name (its other
/// names in ShardedState::aliases).
/// @param model the model.
/// @param rank this rank in the group that saves; only rank 0's tensors are written.
ShardedState replicated_state(torch::nn::Module& model, int rank);

/// Adds `optimizer`'s state of every tensor of `state` it steps (the same tensor object): its moments as tensors
/// laid out like the parameter (same rows, same `saves`), its step count in the metadata. A parameter the optimizer
/// has not stepped yet has no state and adds none.
/// @throws std::invalid_argument for an optimizer other than SGD, Adam and AdamW, or one that steps a tensor that
///         is not in `state` (it must be built over the wrapper's parameters()), naming its group and position.
void add_optimizer_state(ShardedState& state, torch::optim::Optimizer& optimizer);

/// Saves the model's state `model_state` (as the wrapper holds it) and, when `optimizer` is not null, the
/// optimizer's state for it, as a sharded checkpoint in `dir` (checkpoint.h's save_checkpoint). `metadata` goes
/// along (rank 0's). A collective over `comm`, every rank of which saves its part.
/// @throws as add_optimizer_state and save_checkpoint.
void save_training_checkpoint(const std::string& dir, ShardedState model_state, torch::optim::Optimizer* optimizer,
                              Communicator& comm, const std::map<std::string, std::string>& metadata = {});

/// Loads a checkpoint (sharded or full, saved at any world size) into the tensors of `model_state` and, when
/// `optimizer` is not null, into the optimizer's state for them: replaced by the saved state (a parameter with
/// none saved gets none). All or nothing: on any error nothing of the model or the optimizer has changed. A
/// collective over `comm`.
/// @param path the checkpoint's directory, or a safetensors file.
/// @param model_state the model's tensors as the wrapper holds them (checkpoint_state(), replicated_state()).
/// @param optimizer built over the wrapper's parameters(); null: the model only.
/// @param comm every rank that loads.
/// @param optimizer_if_saved true: a checkpoint with no optimizer state (weights only, e.g. exported or from
///        PyTorch) loads the model and leaves `optimizer` as it is; false: it is refused while `optimizer` is given.
/// @return the saved metadata.
/// @throws std::invalid_argument on every rank when the checkpoint holds another model, another optimizer kind,
///         Adam's state without amsgrad's for an amsgrad optimizer, or no optimizer state (see
///         `optimizer_if_saved`); as load_checkpoint otherwise.
/// @param names the model's name of each saved model tensor (checkpoint.h's SavedNames); empty: the saved names.
///        It is not asked about the optimizer's state ("optim.*"), which keeps shardlab's names: "optim.<the
///        model's name>.<field>".
std::map<std::string, std::string> load_training_checkpoint(const std::string& path, ShardedState model_state,
                                                            torch::optim::Optimizer* optimizer, Communicator& comm,
                                                            bool optimizer_if_saved = false,
                                                            const SavedNames& names = {});

}  // namespace shardlab
