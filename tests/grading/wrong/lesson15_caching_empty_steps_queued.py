"""Every step queued, those without a lookup too: an empty step then pushes out the step before it,
which the window had to keep whole."""

from paged_kv.reference.lesson15 import *  # every other task stays right

BREAKS = "15.CachingMetrics"
MESSAGE = "a step without lookups (stats.requests == 0) must change nothing"


class CachingMetrics(CachingMetrics):
    def observe(self, stats):
        # the mistake: no return for a step with stats.requests == 0
        self.query_queue.append((stats.requests, stats.queries, stats.hits))
        self.aggregated_requests += stats.requests
        self.aggregated_query_total += stats.queries
        self.aggregated_query_hit += stats.hits
        while len(self.query_queue) > 1 and self.aggregated_requests > self.max_recent_requests:
            old_requests, old_queries, old_hits = self.query_queue.popleft()
            self.aggregated_requests -= old_requests
            self.aggregated_query_total -= old_queries
            self.aggregated_query_hit -= old_hits
