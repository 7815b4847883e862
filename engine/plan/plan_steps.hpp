// ds — the steps of compile_plan (plan.cpp) that a split model's planning (plan_mesh.cpp) shares with it. Internal
// to engine/plan: the public API is plan.hpp.
#pragma once

#include "engine/plan/plan.hpp"

namespace ds {

// The layout, ZeRO execution and memory of a plan whose other decisions are made. `in_flight`: the micro-batches
// whose activations a rank holds at once (a pipeline stage's, under 1F1B; else 1).
void lay_out(Plan& plan, int stage, int in_flight = 1);

// A rank of pipeline stage `s` of a split model, laid out and executed over its data group (its model the stage's share).
Plan stage_rank_plan(const Plan& plan, size_t s, int zero_stage);
// pipeline.partition "memory": the cut whose heaviest stage needs the least device memory per rank.
void cut_stages_by_memory(Plan& plan, int zero_stage);
// The step's loss, norm and stop flag agreed by the whole world, not the data group.
void agree_over_the_world(Plan& plan);
// A split model: each stage's memory and ZeRO bytes, and the plan's layout, execution and memory the heaviest stage's.
void lay_out_mesh(Plan& plan, int stage);
MeshRequest mesh_request(const Config& c);
// The mesh's shape before the batch; a world it does not divide is reported by plan_mesh.
MeshShape mesh_shape_of(const Config& c, const Topology& topo);
// What a split model's plan counts and what it does not yet (warnings).
void note_mesh(Plan& plan);
// What each stage's rank trains, for count_mesh_traffic: read off each stage's share (share_of).
std::vector<StageTraining> stage_training(const Plan& plan);

}  // namespace ds
