#include "router/eplb.h"

#include <algorithm>
#include <map>
#include <numeric>

namespace k3::router {
namespace {

struct Replica {
  int32_t expert;
  double weight;  // the expert's load over its replica count
};

}  // namespace

std::vector<std::vector<int32_t>> PlaceLayer(std::span<const double> load, int32_t nodes, int64_t slots_per_node,
                                             const std::vector<std::vector<int32_t>>& current, const EplbOptions& options) {
  const int32_t E = static_cast<int32_t>(load.size());
  const int64_t total = slots_per_node * nodes;
  // Replication: each redundant slot to the expert with the largest load per replica (ties: lower id),
  // at most one replica per node.
  std::vector<int32_t> count(E, 1);
  {
    auto less = [&](int32_t a, int32_t b) {
      const double wa = load[a] / count[a], wb = load[b] / count[b];
      return wa < wb || (wa == wb && a > b);
    };
    std::vector<int32_t> heap(E);
    std::iota(heap.begin(), heap.end(), 0);
    std::make_heap(heap.begin(), heap.end(), less);
    for (int64_t extra = total - E; extra > 0 && !heap.empty();) {
      std::pop_heap(heap.begin(), heap.end(), less);
      const int32_t e = heap.back();
      heap.pop_back();
      if (count[e] >= nodes) continue;  // on every node already
      count[e]++;
      extra--;
      heap.push_back(e);
      std::push_heap(heap.begin(), heap.end(), less);
    }
  }
  // Replicas left over when every expert is on every node would leave slots empty; the callers
  // size slots_per_node <= E so that the packing below always fills them.
  std::vector<std::vector<int32_t>> hosts(E);
  std::vector<std::vector<Replica>> on(nodes);
  std::vector<double> node_load(nodes, 0.0);
  auto hosts_expert = [&](int32_t n, int32_t e) { return std::find(hosts[e].begin(), hosts[e].end(), n) != hosts[e].end(); };
  auto put = [&](int32_t n, int32_t e) {
    hosts[e].push_back(n);
    on[n].push_back({e, load[e] / count[e]});
    node_load[n] += load[e] / count[e];
  };
  // Keep what the current placement has where it still fits: an expert's first replicas stay.
  std::vector<Replica> unplaced;
  if (!current.empty()) {
    for (int32_t e = 0; e < E; ++e) {
      int32_t kept = 0;
      if (e < static_cast<int32_t>(current.size()))
        for (int32_t n : current[e])
          if (n >= 0 && n < nodes && kept < count[e] && !hosts_expert(n, e)) {
            put(n, e);
            kept++;
          }
    }
    // A node over its slot count (the pool grew) gives up its lightest replicas.
    for (int32_t n = 0; n < nodes; ++n) {
      auto& v = on[n];
      if (static_cast<int64_t>(v.size()) <= slots_per_node) continue;
      std::stable_sort(v.begin(), v.end(), [](const Replica& a, const Replica& b) { return a.weight > b.weight; });
      while (static_cast<int64_t>(v.size()) > slots_per_node) {
        const Replica r = v.back();
        v.pop_back();
        node_load[n] -= r.weight;
        hosts[r.expert].erase(std::find(hosts[r.expert].begin(), hosts[r.expert].end(), n));
      }
    }
  }
  for (int32_t e = 0; e < E; ++e)
    for (int32_t c = static_cast<int32_t>(hosts[e].size()); c < count[e]; ++c) unplaced.push_back({e, load[e] / count[e]});
  // Packing (longest first): each replica to the least-loaded node with a free slot that does not
  // host the expert yet.
  std::stable_sort(unplaced.begin(), unplaced.end(), [](const Replica& a, const Replica& b) { return a.weight > b.weight; });
  for (const Replica& r : unplaced) {
    int32_t best = -1;
    for (int32_t n = 0; n < nodes; ++n) {
      if (static_cast<int64_t>(on[n].size()) >= slots_per_node || hosts_expert(n, r.expert)) continue;
      if (best < 0 || node_load[n] < node_load[best]) best = n;
    }
    if (best < 0) {
      // Every node with room hosts this expert already: a node m without it hands one of its
      // replicas b to a node n with room (which must not host b), and takes this one.
      for (int32_t n = 0; n < nodes && best < 0; ++n) {
        if (static_cast<int64_t>(on[n].size()) >= slots_per_node) continue;
        for (int32_t m = 0; m < nodes && best < 0; ++m) {
          if (m == n || hosts_expert(m, r.expert)) continue;
          for (size_t j = 0; j < on[m].size(); ++j) {
            const Replica b = on[m][j];
            if (hosts_expert(n, b.expert)) continue;
            on[m].erase(on[m].begin() + static_cast<std::ptrdiff_t>(j));
            node_load[m] -= b.weight;
            *std::find(hosts[b.expert].begin(), hosts[b.expert].end(), m) = n;
            on[n].push_back(b);
            node_load[n] += b.weight;
            best = m;
            break;
          }
        }
      }
      if (best < 0) continue;  // cannot happen while slots_per_node <= E
    }
    put(best, r.expert);
  }
  // Evening out by swaps (slot counts stay equal): the most-loaded node trades a replica for a
  // lighter one until it is within the tolerance or no swap lowers it. Each swap moves two slots,
  // so a placement already within the tolerance stays as it is.
  const double mean = std::accumulate(node_load.begin(), node_load.end(), 0.0) / nodes;
  for (int iter = 0; iter < 100 * nodes && mean > 0; ++iter) {
    const int32_t hot = static_cast<int32_t>(std::max_element(node_load.begin(), node_load.end()) - node_load.begin());
    if (node_load[hot] <= mean * (1.0 + options.tolerance)) break;
    double best_max = node_load[hot];
    int32_t bn = -1;
    size_t bi = 0, bj = 0;
    for (int32_t n = 0; n < nodes; ++n) {
      if (n == hot) continue;
      for (size_t i = 0; i < on[hot].size(); ++i) {
        const Replica& a = on[hot][i];
        if (hosts_expert(n, a.expert)) continue;
        for (size_t j = 0; j < on[n].size(); ++j) {
          const Replica& b = on[n][j];
          if (b.weight >= a.weight || hosts_expert(hot, b.expert)) continue;
          const double m = std::max(node_load[hot] - a.weight + b.weight, node_load[n] - b.weight + a.weight);
          if (m < best_max - 1e-12) {
            best_max = m;
            bn = n;
            bi = i;
            bj = j;
          }
        }
      }
    }
    if (bn < 0) break;
    const Replica a = on[hot][bi], b = on[bn][bj];
    on[hot][bi] = b;
    on[bn][bj] = a;
    node_load[hot] += b.weight - a.weight;
    node_load[bn] += a.weight - b.weight;
    *std::find(hosts[a.expert].begin(), hosts[a.expert].end(), hot) = bn;
    *std::find(hosts[b.expert].begin(), hosts[b.expert].end(), bn) = hot;
  }
  for (auto& h : hosts) std::sort(h.begin(), h.end());
  return hosts;
}

absl::StatusOr<PlacementTable> EplbPlacement(const ModelConfig& c, std::vector<NodeInfo> nodes,
                                             std::span<const int32_t> capacity,
                                             const std::vector<std::vector<double>>& load,
                                             const PlacementTable* current, const EplbOptions& options, uint64_t version) {
  PlacementTable t;
  t.version = version;
  t.nodes = std::move(nodes);
  t.replicas.assign(c.num_layers, {});
  const int32_t N = static_cast<int32_t>(t.nodes.size());
  if (N == 0) return t;
  if (capacity.size() != t.nodes.size())
    return absl::InvalidArgumentError(absl::StrCat("capacity lists ", capacity.size(), " nodes, expected ", N));
  int64_t moe_layers = 0;
  for (int64_t l = 0; l < c.num_layers; ++l) moe_layers += c.mlp[l] == Mlp::kMoe;
  if (moe_layers == 0) return t;
  const int64_t E = c.num_experts;
  // Equal slots on every node and layer: what the redundancy asks for, within the smallest capacity.
  int64_t per_node = std::min<int64_t>(E, (static_cast<int64_t>(static_cast<double>(E) * (1.0 + options.redundancy) + 0.999999) + N - 1) / N);
  for (int32_t cap : capacity)
    if (cap > 0) per_node = std::min<int64_t>(per_node, cap / moe_layers);
  if (per_node * N < E)
    return absl::FailedPreconditionError(absl::StrCat("the expert pool holds ", per_node * N, " slots per MoE layer (", N,
                                                      " nodes), the model needs ", E, ": add expert nodes or raise --slots"));
  // The current placement's hosts in the new node numbering.
  std::vector<int32_t> renumber;
  if (current) {
    std::map<std::string, int32_t> index;
    for (int32_t n = 0; n < N; ++n) index[t.nodes[n].node_id] = n;
    for (const NodeInfo& n : current->nodes) {
      auto it = index.find(n.node_id);
      renumber.push_back(it == index.end() ? -1 : it->second);
    }
  }
  for (int64_t l = 0; l < c.num_layers; ++l) {
    if (c.mlp[l] != Mlp::kMoe) continue;
    std::vector<double> w(E, 1.0);
    if (l < static_cast<int64_t>(load.size()) && static_cast<int64_t>(load[l].size()) == E &&
        std::accumulate(load[l].begin(), load[l].end(), 0.0) > 0)
      w = load[l];
    std::vector<std::vector<int32_t>> cur;
    if (current && l < static_cast<int64_t>(current->replicas.size()) && !current->replicas[l].empty()) {
      cur = current->replicas[l];
      for (auto& h : cur)
        for (int32_t& n : h) n = n >= 0 && n < static_cast<int32_t>(renumber.size()) ? renumber[n] : -1;
    }
    t.replicas[l] = PlaceLayer(w, N, per_node, cur, options);
  }
  return t;
}

std::vector<double> NodeLoads(const PlacementTable& t, const std::vector<std::vector<double>>& load, int64_t layer) {
  std::vector<double> out(t.nodes.size(), 0.0);
  for (size_t l = 0; l < t.replicas.size() && l < load.size(); ++l) {
    if (layer >= 0 && static_cast<int64_t>(l) != layer) continue;
    for (size_t e = 0; e < t.replicas[l].size() && e < load[l].size(); ++e) {
      const auto& h = t.replicas[l][e];
      for (int32_t n : h) out[n] += load[l][e] / static_cast<double>(h.size());
    }
  }
  return out;
}

double NodeImbalance(const PlacementTable& t, const std::vector<std::vector<double>>& load, int64_t layer) {
  const std::vector<double> n = NodeLoads(t, load, layer);
  if (n.empty()) return 1.0;
  const double mean = std::accumulate(n.begin(), n.end(), 0.0) / static_cast<double>(n.size());
  return mean > 0 ? *std::max_element(n.begin(), n.end()) / mean : 1.0;
}

int64_t SlotsMoved(const PlacementTable& from, const PlacementTable& to) {
  int64_t moved = 0;
  for (size_t l = 0; l < to.replicas.size(); ++l)
    for (size_t e = 0; e < to.replicas[l].size(); ++e)
      for (int32_t n : to.replicas[l][e]) {
        bool had = false;
        if (l < from.replicas.size() && e < from.replicas[l].size())
          for (int32_t m : from.replicas[l][e]) had = had || from.nodes[m].node_id == to.nodes[n].node_id;
        moved += !had;
      }
  return moved;
}

}  // namespace k3::router
