// shardlab: train a model on N local ranks with a chosen strategy and compare it with one device (cli.h).
#include "cli.h"

int main(int argc, char** argv) { return shardlab::cli::shardlab_main(argc, argv); }
