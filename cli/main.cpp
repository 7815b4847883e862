// ds — entry point. Everything lives in cli/app.cpp so tests can drive it without a process.
#include "cli/app.hpp"

int main(int argc, char** argv) { return ds::cli::run_ds(argc, argv); }
