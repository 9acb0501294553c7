// decide's cuda ranking backend: the device mirror of decide/index.py and one kernel that
// ranks a whole batch of requests. Compiled at run time by NVRTC (decide/cuda.py) to a
// CUBIN for the device's own sm_<major><minor>. Every floating-point expression repeats
// kvledger/reuse.py's operations in the same order, and the program is built with
// --fmad=false, so the doubles equal the reference's bit for bit.

#define STORED_CLASSES 4   // native device, native host, native disk, retained device
#define PREFIX_CLASSES 5   // device, host, disk, any native, native ∪ retained device
#define EMPTY_ROW (-1)
#define MISSING_ROW 0      // row 0 is all zeros
#define HASH_MULTIPLIER 0x9E3779B97F4A7C15ull

// Reason codes, in the order of decide/ranked.py's REASONS.
#define REASON_DISABLED 0
#define REASON_CHOSEN 1
#define REASON_NO_WORKERS 2
#define REASON_NO_CANDIDATES 3
#define REASON_BELOW_THRESHOLD 4
#define REASON_BUDGET_EXHAUSTED 5

#define RANK_THREADS 256

typedef unsigned long long u64;

// Table scatter: the host decides where keys go (it owns the probe sequence); the device
// only copies the changed slots, so an update costs the dirty entries, not the table.
extern "C" __global__ void scatter_table(u64* table_keys, int* table_rows, const long long* positions,
                                         const u64* keys, const int* rows, int count) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) {
        table_keys[positions[i]] = keys[i];
        table_rows[positions[i]] = rows[i];
    }
}

// Row scatter: each dirty row's whole bitmask block (STORED_CLASSES × words) is replaced.
extern "C" __global__ void scatter_rows(u64* masks, const long long* row_ids, const u64* values,
                                        int count, int row_words) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < (long long)count * row_words) {
        long long entry = i / row_words;
        int word = (int)(i % row_words);
        masks[row_ids[entry] * row_words + word] = values[i];
    }
}

__device__ __forceinline__ int find_row(const u64* table_keys, const int* table_rows, int table_bits, u64 key) {
    u64 mask = (1ull << table_bits) - 1ull;
    u64 position = (key * HASH_MULTIPLIER) >> (64 - table_bits);
    while (true) {
        int row = table_rows[position];
        if (row == EMPTY_ROW) return MISSING_ROW;
        if (table_keys[position] == key) return row;
        position = (position + 1ull) & mask;
    }
}

struct Ranked {
    double saving;
    int prefix;
    int tier;
    int order;
};

// kvledger.reuse.ranking_key: saving (higher first), longer prefix, tier, worker order.
__device__ __forceinline__ bool ranks_before(const Ranked& a, const Ranked& b) {
    if (a.saving != b.saving) return a.saving > b.saving;
    if (a.prefix != b.prefix) return a.prefix > b.prefix;
    if (a.tier != b.tier) return a.tier < b.tier;
    return a.order < b.order;
}

// One thread block per request; threads stride over workers. Outputs per request: the
// prefix lengths of every worker, target, credit, baseline, reason, and its eligible
// candidates in rank order, appended to flat arrays at a base taken from `total`.
extern "C" __global__ void __launch_bounds__(RANK_THREADS) rank_requests(
    const u64* table_keys, const int* table_rows, int table_bits,
    const u64* masks, int words,
    const u64* hashes, const long long* offsets, int requests,
    const int* given_target, const unsigned char* named, const int* block_sizes,
    const int* order_rank, int workers,
    double device_weight, double host_weight, double disk_weight,
    int tier_flags, int scan, int minimum_blocks, double minimum_saving,
    double prefill_token_us, double host_block_us, double device_block_us,
    int* block_rows, double* credits,
    int* lengths, int* target_out, double* credited_out, int* baseline_out, signed char* reason_out,
    int* scratch_slot, int* scratch_tier, int* scratch_prefix, int* scratch_transfer,
    double* scratch_recompute, double* scratch_transfer_ms, double* scratch_saving,
    int* total,
    int* out_request, int* out_slot, int* out_tier, int* out_prefix, int* out_transfer,
    double* out_recompute, double* out_transfer_ms, double* out_saving) {
    const int request = blockIdx.x;
    if (request >= requests) return;
    const long long start = offsets[request];
    const int blocks = (int)(offsets[request + 1] - start);

    for (int b = threadIdx.x; b < blocks; b += blockDim.x) {
        block_rows[start + b] = find_row(table_keys, table_rows, table_bits, hashes[start + b]);
    }
    __syncthreads();

    // Each worker walks the request from block 0 until every one of its prefixes has ended;
    // most workers hold nothing and stop at the first block.
    for (int w = threadIdx.x; w < workers; w += blockDim.x) {
        const int word = w >> 6;
        const u64 bit = 1ull << (w & 63);
        int length[PREFIX_CLASSES] = {0, 0, 0, 0, 0};
        bool alive[PREFIX_CLASSES] = {true, true, true, true, true};
        double credit = 0.0;
        for (int b = 0; b < blocks; ++b) {
            const u64* row = masks + (long long)block_rows[start + b] * STORED_CLASSES * words + word;
            const bool device = (row[0] & bit) != 0ull;
            const bool host = (row[words] & bit) != 0ull;
            const bool disk = (row[2 * words] & bit) != 0ull;
            const bool retained = (row[3 * words] & bit) != 0ull;
            const bool held[PREFIX_CLASSES] = {device, host, disk, device || host || disk, device || retained};
            bool any_alive = false;
            for (int c = 0; c < PREFIX_CLASSES; ++c) {
                if (alive[c]) {
                    if (held[c]) length[c] += 1; else alive[c] = false;
                }
                any_alive = any_alive || alive[c];
            }
            if (alive[3]) {
                // max() over the weights of the tiers holding the block, as the reference does
                double best = -1.0;
                if (device && (best < 0.0 || device_weight > best)) best = device_weight;
                if (host && (best < 0.0 || host_weight > best)) best = host_weight;
                if (disk && (best < 0.0 || disk_weight > best)) best = disk_weight;
                credit += best;
            }
            if (!any_alive) break;
        }
        for (int c = 0; c < PREFIX_CLASSES; ++c) {
            lengths[((long long)request * PREFIX_CLASSES + c) * workers + w] = length[c];
        }
        credits[(long long)request * workers + w] = credit;
    }
    __syncthreads();

    __shared__ double best_credit[RANK_THREADS];
    __shared__ int best_worker[RANK_THREADS];
    __shared__ int target, baseline, count, longer, base;
    if (!named[request]) {
        // The worker with the most credit; ties go to worker order.
        double mine = -1.0;
        int mine_worker = -1;
        for (int w = threadIdx.x; w < workers; w += blockDim.x) {
            const double c = credits[(long long)request * workers + w];
            if (mine_worker < 0 || c > mine || (c == mine && order_rank[w] < order_rank[mine_worker])) {
                mine = c;
                mine_worker = w;
            }
        }
        best_credit[threadIdx.x] = mine;
        best_worker[threadIdx.x] = mine_worker;
        __syncthreads();
        for (int half = blockDim.x / 2; half > 0; half /= 2) {
            if (threadIdx.x < half) {
                const int other = best_worker[threadIdx.x + half];
                const int here = best_worker[threadIdx.x];
                const double oc = best_credit[threadIdx.x + half];
                const double hc = best_credit[threadIdx.x];
                if (other >= 0 && (here < 0 || oc > hc || (oc == hc && order_rank[other] < order_rank[here]))) {
                    best_credit[threadIdx.x] = oc;
                    best_worker[threadIdx.x] = other;
                }
            }
            __syncthreads();
        }
    }
    if (threadIdx.x == 0) {
        target = named[request] ? given_target[request] : best_worker[0];
        baseline = target >= 0 ? lengths[((long long)request * PREFIX_CLASSES + 4) * workers + target] : 0;
        count = 0;
        longer = 0;
        target_out[request] = target;
        credited_out[request] = target >= 0 ? credits[(long long)request * workers + target] : 0.0;
        baseline_out[request] = baseline;
    }
    __syncthreads();

    const bool has_target = named[request] || target >= 0;
    if (tier_flags == 0 || !has_target || !scan) {
        if (threadIdx.x == 0) {
            reason_out[request] = tier_flags == 0 ? REASON_DISABLED
                                : !has_target    ? REASON_NO_WORKERS
                                                 : REASON_BUDGET_EXHAUSTED;
        }
        return;
    }

    const long long scratch = (long long)request * 3 * workers;
    const long long block_size = block_sizes[request];
    for (int w = threadIdx.x; w < workers; w += blockDim.x) {
        if (w == target) continue;
        for (int tier = 0; tier < 3; ++tier) {
            if (!(tier_flags & (1 << tier))) continue;
            const int prefix = lengths[((long long)request * PREFIX_CLASSES + tier) * workers + w];
            if (prefix <= baseline) continue;
            longer = 1;
            const long long transfer_blocks = prefix - baseline;
            // kvledger/cost.py's model, the same expressions in the same order (bit-equal floats).
            const double recompute_ms = (double)(transfer_blocks * block_size) * prefill_token_us / 1000.0;
            const double transfer_ms = (double)transfer_blocks * (tier == 0 ? device_block_us : host_block_us) / 1000.0;
            const double saving_ms = recompute_ms - transfer_ms;
            if (transfer_blocks >= minimum_blocks && saving_ms >= minimum_saving) {
                const int at = atomicAdd(&count, 1);
                scratch_slot[scratch + at] = w;
                scratch_tier[scratch + at] = tier;
                scratch_prefix[scratch + at] = prefix;
                scratch_transfer[scratch + at] = (int)transfer_blocks;
                scratch_recompute[scratch + at] = recompute_ms;
                scratch_transfer_ms[scratch + at] = transfer_ms;
                scratch_saving[scratch + at] = saving_ms;
            }
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        base = atomicAdd(total, count);
        reason_out[request] = count > 0 ? REASON_CHOSEN : (longer ? REASON_BELOW_THRESHOLD : REASON_NO_CANDIDATES);
    }
    __syncthreads();

    // Rank by counting: (worker, tier) pairs are unique, so the ranks form a permutation.
    for (int i = threadIdx.x; i < count; i += blockDim.x) {
        const Ranked mine = {scratch_saving[scratch + i], scratch_prefix[scratch + i], scratch_tier[scratch + i],
                             order_rank[scratch_slot[scratch + i]]};
        int rank = 0;
        for (int j = 0; j < count; ++j) {
            const Ranked other = {scratch_saving[scratch + j], scratch_prefix[scratch + j], scratch_tier[scratch + j],
                                  order_rank[scratch_slot[scratch + j]]};
            if (ranks_before(other, mine)) rank += 1;
        }
        const long long out = (long long)base + rank;
        out_request[out] = request;
        out_slot[out] = scratch_slot[scratch + i];
        out_tier[out] = scratch_tier[scratch + i];
        out_prefix[out] = scratch_prefix[scratch + i];
        out_transfer[out] = scratch_transfer[scratch + i];
        out_recompute[out] = scratch_recompute[scratch + i];
        out_transfer_ms[out] = scratch_transfer_ms[scratch + i];
        out_saving[out] = scratch_saving[scratch + i];
    }
}
