//! Context parallelism: sharding layouts, ring / zigzag / striped ring attention, all-gather KV.
