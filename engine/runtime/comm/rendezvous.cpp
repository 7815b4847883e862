#include "engine/runtime/comm/rendezvous.hpp"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <stdexcept>

namespace ds {

c10::intrusive_ptr<c10d::Store> open_world_store(const Topology& t, std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(t.master_port);
  so.isServer = t.rank == 0;
  so.numWorkers = static_cast<size_t>(t.world_size);
  so.waitWorkers = true;
  so.timeout = timeout;
  try {
    return c10::make_intrusive<c10d::TCPStore>(t.master_addr, so);
  } catch (const std::exception& e) {
    const std::string what = e.what();
    throw std::runtime_error("rank " + std::to_string(t.rank) + " could not join the group at " + t.master_addr + ":" +
                             std::to_string(t.master_port) + " within " + std::to_string(timeout.count() / 1000) + " s: " +
                             what.substr(0, what.find('\n')));
  }
}

std::string share_from_rank0(c10d::Store& store, const std::string& key, int rank, std::chrono::milliseconds timeout,
                             const std::function<std::string()>& make, const std::string& what) {
  if (rank == 0) {
    const std::string bytes = make();
    store.set(key, std::vector<uint8_t>(bytes.begin(), bytes.end()));
    return bytes;
  }
  try {
    store.wait({key}, timeout);
    const std::vector<uint8_t> got = store.get(key);
    return std::string(got.begin(), got.end());
  } catch (const std::exception& e) {
    const std::string why = e.what();
    throw std::runtime_error("rank " + std::to_string(rank) + " waited " + std::to_string(timeout.count() / 1000) + " s for rank 0's " +
                             what + ", which never came (rank 0 failed or is stuck before it): " + why.substr(0, why.find('\n')));
  }
}

}  // namespace ds
